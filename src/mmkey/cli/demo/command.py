"""``mmkey demo``: the main job on the embedded default cache (or on Mooncake)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from mmkey.cli._common import scheme_option_type

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from mmkey.cache.mooncake.usage import StoreUsage
    from mmkey.cache.protocol import EmbeddingCache
    from mmkey.cli.demo import DemoResult
    from mmkey.encoder import EncodeReport

__all__ = ["demo"]


def _memory_cache(max_bytes: int) -> EmbeddingCache:
    from mmkey.cache.memory import MemoryCache

    return MemoryCache(max_bytes)


def _mooncake_cache(master: str | None) -> EmbeddingCache:
    try:
        from mmkey.cache.mooncake import MooncakeCache, MooncakeConfig
    except ImportError as exc:
        raise click.ClickException(f"Mooncake adapter not available: {exc}") from None
    from mmkey.errors import StoreError

    try:
        if master is None:
            config = MooncakeConfig.from_env()
        else:
            config = MooncakeConfig.from_env(master_server_address=master)
    except (TypeError, ValueError) as exc:
        raise click.UsageError(f"--store mooncake: {exc}") from None
    try:
        cache = MooncakeCache(config)
    except StoreError as exc:
        raise click.ClickException(f"--store mooncake: {exc}") from None
    if not cache.is_connected():
        click.echo(
            f"mmkey demo: warning: the Mooncake store at {config.master_server_address} is "
            "not reachable; running anyway: every lookup misses and every image is encoded",
            err=True,
        )
    return cache


def _held_rows(result: DemoResult, usage: StoreUsage | None, metrics: str | None) -> list[tuple[str, str]]:
    """What the cache holds, as far as it is known: a remote store's client says it cannot know,
    counts what it wrote, and adds the master's own counts when its metrics endpoint is given."""
    stats = result.cache_stats
    if stats.entries is not None and stats.bytes_held is not None:
        return [("cache held", f"{stats.entries} entries, {stats.bytes_held / 1e6:.1f} MB")]
    rows = [
        ("cache held", "unknown to this client (the entries live in the store's holders)"),
        ("written by this client", f"{stats.inserts} entries"),
    ]
    if usage is not None:
        rows.append(
            (
                "store, master's count",
                f"{usage.keys} keys, {usage.allocated_bytes / 1e6:.1f} MB of "
                f"{usage.capacity_bytes / 1e6:.0f} MB in {usage.segments} segment(s), all clients",
            )
        )
    elif metrics is not None:
        rows.append(("store, master's count", f"unknown: no answer from http://{metrics}/metrics"))
    else:
        rows.append(("store, master's count", "not asked (give --master-metrics HOST:PORT)"))
    return rows


def _summary(
    result: DemoResult, store: str, usage: StoreUsage | None = None, metrics: str | None = None
) -> Table:
    from rich.table import Table

    r = result.report
    table = Table(title="mmkey demo: cache-aware encoding", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    table.add_row("store", store)
    table.add_row("namespace", result.namespace)
    table.add_row("requests", f"{result.requests}")
    table.add_row("images", f"{r.items} ({r.duplicates} repeated within a request)")
    table.add_row("cache lookups", f"{r.unique} (distinct images per request)")
    table.add_row("cache hits", f"{r.hits}")
    table.add_row("hit rate", f"{r.hit_rate:.1%}")
    table.add_row("encoder calls", f"{r.encoded} with the cache, {r.items} without")
    table.add_row("encoder calls saved", f"{r.saved} ({r.saved / max(r.items, 1):.1%})")
    table.add_row("time with the cache", f"{result.cached_seconds:.2f} s")
    if result.direct_seconds is not None:
        table.add_row(
            "time without the cache",
            f"{result.direct_seconds:.2f} s (measured)",
        )
        table.add_row("speed-up", f"{result.speedup or 0.0:.2f}x")
        table.caption = (
            "without the cache: the same requests, every image through the same encoder, timed alongside"
        )
    table.add_row(
        "hashed",
        f"{r.hashed_bytes / 1e6:.0f} MB in {r.hash_seconds * 1e3:.0f} ms ({result.hash_gb_per_s:.2f} GB/s)",
    )
    table.add_row(
        "time in cache calls",
        f"{(r.lookup_seconds + r.insert_seconds) * 1e3:.0f} ms",
    )
    for name, value in _held_rows(result, usage, metrics):
        table.add_row(name, value)
    table.add_row(
        "cache failures",
        f"{r.cache_errors} swallowed, {r.stale} stale entries, {r.insert_failures} inserts refused",
    )
    if result.max_abs_diff is not None:
        table.add_row("results vs. no cache", f"max |diff| {result.max_abs_diff:.2e}")
    return table


@click.command()
@click.option("--requests", type=click.IntRange(1), default=80, show_default=True)
@click.option(
    "--pool",
    type=click.IntRange(1),
    default=100,
    show_default=True,
    help="Distinct images the stream draws from (Zipf-like popularity).",
)
@click.option(
    "--max-images", type=click.IntRange(1), default=4, show_default=True, help="Most images in one request."
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the stream and of the encoder's weights."
)
@click.option("--scheme", type=scheme_option_type, default="blake3", show_default=True)
@click.option(
    "--store",
    type=click.Choice(["memory", "mooncake"]),
    default="memory",
    show_default=True,
    help="memory: the embedded MemoryCache; mooncake: a store.",
)
@click.option(
    "--master",
    envvar="MOONCAKE_MASTER",
    metavar="HOST:PORT",
    help="Mooncake master for --store mooncake [env: MOONCAKE_MASTER].",
)
@click.option(
    "--master-metrics",
    envvar="MMKEY_MASTER_METRICS",
    metavar="HOST:PORT",
    help="The master's metrics endpoint (its --metrics_port), to report what the "
    "store holds [env: MMKEY_MASTER_METRICS].",
)
@click.option(
    "--cache-mb",
    type=click.IntRange(1),
    default=256,
    show_default=True,
    help="Byte budget of the memory cache, in MiB.",
)
@click.option(
    "--baseline/--no-baseline",
    default=True,
    show_default=True,
    help="Also encode every request without the cache, to time and check it.",
)
@click.option("--progress/--no-progress", default=True, show_default=True)
def demo(
    requests: int,
    pool: int,
    max_images: int,
    seed: int,
    scheme: str,
    store: str,
    master: str | None,
    master_metrics: str | None,
    cache_mb: int,
    baseline: bool,
    progress: bool,
) -> None:
    """Encode a stream of synthetic images through the embedding cache.

    Qwen2-VL-style requests with repeated images go through encode_with_cache and a
    small real vision encoder (CPU, fixed seed); a summary table follows.
    """
    from rich.console import Console

    from mmkey.cli.demo import StreamConfig, VisionConfig, run_demo
    from mmkey.digest import HashScheme

    if master_metrics is not None:
        from mmkey.cache.mooncake._net import parse_host_port

        try:
            parse_host_port(master_metrics)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--master-metrics") from None
    usage = None
    if store == "mooncake":
        cache = _mooncake_cache(master)
        where = f"mooncake ({master})" if master else "mooncake"
    else:
        cache = _memory_cache(cache_mb << 20)
        where = f"memory (MemoryCache, {cache_mb} MiB)"
    stream = StreamConfig(requests=requests, pool=pool, max_images=max_images, seed=seed)
    console = Console()
    try:
        with _ProgressBar(Console(stderr=True), requests, progress) as advance:
            result = run_demo(
                cache,
                stream=stream,
                vision=VisionConfig(seed=seed),
                scheme=HashScheme(scheme),
                baseline=baseline,
                on_request=advance,
            )
        if master_metrics is not None:  # before close: this client may lend memory itself
            from mmkey.cache.mooncake.usage import read_master_usage

            usage = read_master_usage(master_metrics)
    finally:
        cache.close()
    console.print(_summary(result, where, usage, master_metrics))


class _ProgressBar:
    """A rich progress bar over the requests, advanced by calling it; nothing when
    disabled or when stderr is not a terminal."""

    def __init__(self, console: Console, total: int, enabled: bool) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("encoding"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests, {task.fields[hits]} hits"),
            TimeElapsedColumn(),
            console=console,
            disable=not (enabled and console.is_terminal),
            transient=True,
        )
        self._task = self._progress.add_task("encoding", total=total, hits=0)
        self._hits = 0

    def __enter__(self) -> Callable[[EncodeReport], None]:
        self._progress.start()
        return self._advance

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def _advance(self, report: EncodeReport) -> None:
        self._hits += report.hits
        self._progress.update(self._task, advance=1, hits=self._hits)
