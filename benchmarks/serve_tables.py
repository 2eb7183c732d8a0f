"""The serving benchmark's summaries and tables: one row per configuration and concurrency,
the hit path against the tower, and the targets met or missed (standard library only)."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loadgen import Outcome, format_table, percentile

__all__ = ["VLLM_HIT_LABELS", "Report", "Summary", "render", "summarize"]

MiB = 1 << 20
VLLM_HIT_LABELS = {
    "lookup": "lookup (batch_is_exist)",
    "fetch": "fetch + verify (get_embeddings)",
    "tower": "tower, per image (in the engines)",
}
"""The hit path table's row names in `bench_serve` (vLLM's calls)."""


@dataclass(frozen=True)
class Summary:
    """One cell: a configuration at one reuse level and one concurrency."""

    row: str
    reuse: float
    clients: int
    requests: int
    failed: int
    rate: float
    p50: float
    p90: float
    p99: float
    tower_images: float
    tower_s: float
    moved_bytes: float
    loaded_items: float
    beside: tuple[float, float] | None = None
    """p50 and p99 ms of each request's latency less its own tower time (what the cache and
    the server add), where every request's tower time is known (one client)."""

    @property
    def hit_rate(self) -> float:
        """The share of requests whose image the tower did not encode."""
        return max(0.0, 1.0 - self.tower_images / self.requests) if self.requests else 0.0

    @property
    def tower_ms(self) -> float:
        """Mean milliseconds the tower spent per image it encoded."""
        return self.tower_s / self.tower_images * 1e3 if self.tower_images else 0.0


def summarize(
    row: str,
    reuse: float,
    clients: int,
    outcomes: Sequence[Outcome],
    wall: float,
    counts: Mapping[str, float],
) -> Summary:
    """A cell's outcomes (time to first token over the requests that succeeded) and counters."""
    done = [o for o in outcomes if o.ok]
    ttft = [o.first * 1e3 for o in done] or [float("nan")]
    beside = None
    if done and all(o.tower is not None for o in done):
        rest = [(o.first - (o.tower or 0.0)) * 1e3 for o in done]
        beside = (percentile(rest, 0.5), percentile(rest, 0.99))
    return Summary(
        row=row,
        reuse=reuse,
        clients=clients,
        requests=len(outcomes),
        failed=sum(not o.ok for o in outcomes),
        rate=len(outcomes) / wall if wall > 0 else 0.0,
        p50=percentile(ttft, 0.5),
        p90=percentile(ttft, 0.9),
        p99=percentile(ttft, 0.99),
        tower_images=counts.get("tower_images", 0.0),
        tower_s=counts.get("tower_s", 0.0),
        moved_bytes=counts.get("loaded_bytes", 0.0) + counts.get("saved_bytes", 0.0),
        loaded_items=counts.get("loaded_items", 0.0),
        beside=beside,
    )


@dataclass(frozen=True)
class Report:
    """Everything one run prints."""

    cells: list[Summary]
    fault: Summary | None
    hit_ms: dict[str, float]
    timeout_s: float
    load: float
    minutes: float
    engines: int
    requests: int
    notes: list[str] = field(default_factory=list)
    script: str = "benchmarks/bench_serve.py"
    servers: str = "vLLM 0.32 CPU engines (`vllm serve`, OpenAI API)"
    """What ran, after their number in the header line."""
    latency: str = "TTFT"
    """The name of the latency the tables give percentiles of."""
    hit_labels: dict[str, str] = field(default_factory=lambda: dict(VLLM_HIT_LABELS))
    """The hit path table's row names: ``lookup``, ``fetch`` and ``tower``."""
    started: str = ""
    """When the run began (UTC), for the header line; empty: not printed."""


def _cell_rows(cells: Sequence[Summary]) -> list[list[object]]:
    return [
        [
            f"{c.row}, {c.clients} clients",
            round(c.rate, 2),
            c.p50,
            c.p90,
            c.p99,
            int(c.tower_images),
            round(c.tower_ms, 1),
            round(c.hit_rate * 100),
            round(c.moved_bytes / MiB, 1),
            c.failed,
        ]
        for c in cells
    ]


def _find(cells: Sequence[Summary], row: str, reuse: float, clients: int) -> Summary | None:
    return next((c for c in cells if (c.row, c.reuse, c.clients) == (row, reuse, clients)), None)


def tower_ms(cells: Sequence[Summary]) -> float:
    """The tower's mean time per image over the cells that ran it most (the none row)."""
    images = sum(c.tower_images for c in cells)
    return sum(c.tower_s for c in cells) / images * 1e3 if images else 0.0


def targets(report: Report) -> list[str]:
    """One line per target: the measured value, met or missed."""
    lines = []
    hit = sum(report.hit_ms.values())
    tower = tower_ms([c for c in report.cells if c.row == "none"] or report.cells)
    if hit and tower:
        share = hit / tower * 100
        lines.append(f"hit path <= 5% of the tower: {share:.1f}% ({'met' if share <= 5 else 'missed'})")
    for c in report.cells:
        none = _find(report.cells, "none", c.reuse, c.clients)
        if c.row != "mmkey" or none is None:
            continue
        if c.reuse >= 0.8:
            cut = (1 - c.p50 / none.p50) * 100
            verdict = "met" if cut >= 50 else "missed"
            lines.append(
                f"p50 at {c.reuse:.0%} reuse, {c.clients} clients: {cut:.0f}% below none ({verdict})"
            )
        verdict = "met" if c.p99 <= none.p99 else "missed"
        lines.append(
            f"p99 at {c.reuse:.0%} reuse, {c.clients} clients: "
            f"mmkey {c.p99:.0f} ms, none {none.p99:.0f} ms ({verdict})"
        )
    if report.fault is not None:
        f = report.fault
        none = _find(report.cells, "none", f.reuse, f.clients)
        if none is not None:
            bound = none.p99 + report.timeout_s * 1e3
            verdict = "met" if f.p99 <= bound else "missed"
            lines.append(
                f"store paused, {f.clients} clients: p99 {f.p99:.0f} ms, bound none p99 + "
                f"{report.timeout_s:.1f} s = {bound:.0f} ms ({verdict})"
            )
    return lines


def render(report: Report, image_tokens: int, tower: str) -> str:
    """The whole printout: a header, a table per reuse level, the hit path, the targets."""
    header = [
        "configuration",
        "requests/s",
        f"{report.latency} p50 ms",
        "p90 ms",
        "p99 ms",
        "tower runs",
        "tower ms/image",
        "hit rate %",
        "MiB moved",
        "failed",
    ]
    out = [
        f"{report.script}: {report.engines} {report.servers}, "
        f"tower {tower} ({image_tokens} image tokens), {report.requests} requests a cell; "
        f"{f'run {report.started}, ' if report.started else ''}"
        f"{os.cpu_count()} cores ({platform.machine()}), load average up to {report.load:.1f} during the "
        f"run, {report.minutes:.1f} min. Absolute times are this CPU's; the ratios are the claim.",
    ]
    for reuse in sorted({c.reuse for c in report.cells}):
        cells = [c for c in report.cells if c.reuse == reuse]
        out += ["", f"{reuse:.0%} of requests repeat an image:", "", format_table(header, _cell_rows(cells))]
    if report.fault is not None:
        out += [
            "",
            "the store's holder paused (SIGSTOP):",
            "",
            format_table(header, _cell_rows([report.fault])),
        ]
    tower_cost = tower_ms([c for c in report.cells if c.row == "none"] or report.cells)
    if report.hit_ms:
        hit = sum(report.hit_ms.values())
        labels = report.hit_labels
        rows: list[list[object]] = [
            [labels["lookup"], report.hit_ms.get("lookup", 0.0)],
            [labels["fetch"], report.hit_ms.get("fetch", 0.0)],
            ["hit path, total", hit],
            [labels["tower"], tower_cost],
        ]
        out += ["", format_table(["one image (ms)", "median ms"], rows)]
    timed = [c for c in report.cells if c.beside is not None]
    if timed:
        out += [
            "",
            f"one client: each request's {report.latency} less its own tower time (what the server and "
            "the cache add to it; the tower's own run time varies with the host):",
            "",
            format_table(
                ["configuration", "reuse", "p50 ms", "p99 ms"],
                [[c.row, f"{c.reuse:.0%}", *(c.beside or (0.0, 0.0))] for c in timed],
            ),
        ]
    out += ["", "targets:", *(f"- {line}" for line in targets(report)), *report.notes]
    return "\n".join(out)
