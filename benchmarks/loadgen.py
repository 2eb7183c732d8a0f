"""The serving benchmark's load generator: a seeded trace, a bounded async HTTP client, tables.

Standard library only. A trace is a list of image ids in request order, with an exact share of
repeats drawn Zipf-like from the images already seen (the first seen is the most popular). The
client speaks HTTP/1.1 to loopback addresses only, one connection per request, and times a
streamed response's first chunk (time to first token) and its end. `replay` keeps at most
``clients`` requests in flight (closed loop: each client sends its next request when its last
one ended); `turns` sends several rows' requests one at a time, the rows taking turns, and
`servers_on_one_core` runs their servers on one core while it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "Outcome",
    "by_cell",
    "format_table",
    "gained",
    "interleaved",
    "make_trace",
    "percentile",
    "replay",
    "repeat_share",
    "servers_on_one_core",
    "stream_post",
    "turns",
]


def make_trace(requests: int, repeats: float, seed: int, *, zipf_s: float = 1.1) -> list[int]:
    """``requests`` image ids (0, 1, 2... in order of first use): ``round(repeats * requests)``
    of them repeat an image seen before (never the first), the image of rank ``r`` among those
    seen chosen with weight ``1 / r**zipf_s``; the same arguments give the same trace."""
    if requests < 0 or not 0.0 <= repeats <= 1.0:
        raise ValueError(f"make_trace: requests >= 0 and 0 <= repeats <= 1 (got {requests}, {repeats})")
    rng = random.Random(seed)
    wanted = min(round(repeats * requests), max(requests - 1, 0))
    repeat_at = set(rng.sample(range(1, requests), wanted)) if wanted else set()
    trace: list[int] = []
    weights: list[float] = []
    seen = 0
    for i in range(requests):
        if i in repeat_at:
            trace.append(rng.choices(range(seen), weights=weights)[0])
        else:
            trace.append(seen)
            seen += 1
            weights.append(1.0 / seen**zipf_s)
    return trace


def interleaved(
    rows: Sequence[str], plan: Sequence[tuple[float, int]]
) -> list[tuple[str, tuple[float, int]]]:
    """The order the cells run in: every row of one cell back to back, the first row turning
    from cell to cell, so that rows compare under the same state of a shared host (its load
    drifts over minutes) and no row always runs first."""
    return [(rows[(k + j) % len(rows)], cell) for k, cell in enumerate(plan) for j in range(len(rows))]


def by_cell(order: Sequence[tuple[str, tuple[float, int]]]) -> list[tuple[tuple[float, int], list[str]]]:
    """`interleaved`'s order as each cell with its rows, in the order they run."""
    cells: dict[tuple[float, int], list[str]] = {}
    for row, cell in order:
        cells.setdefault(cell, []).append(row)
    return list(cells.items())


def gained(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]) -> dict[str, float]:
    """What each counter gained from ``before`` to ``after`` (one dict per server), summed over
    the servers."""
    total: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for k in a:
            total[k] = total.get(k, 0.0) + a[k] - b.get(k, 0.0)
    return total


def repeat_share(trace: Sequence[int]) -> float:
    """The share of a trace's requests whose image came earlier in it."""
    return (len(trace) - len(set(trace))) / len(trace) if trace else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between the nearest ranks."""
    if not values or not 0.0 <= q <= 1.0:
        raise ValueError("percentile: values must not be empty and 0 <= q <= 1")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; floats with one decimal, other cells as ``str``."""

    def cell(value: object) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    if any(len(row) != len(header) for row in rows):
        raise ValueError("format_table: every row needs one cell per column")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Outcome:
    """One request: seconds to the first chunk of the body and to its end, or an error."""

    first: float
    total: float
    status: int
    error: str = ""
    body: bytes = b""
    tower: float | None = None
    """Seconds the tower ran for this request, where known (one client at a time: the tower
    counter's change over the request); ``None`` where not measured."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


async def _read_chunked(reader: asyncio.StreamReader, start: float) -> tuple[float, bytes]:
    first = 0.0
    parts: list[bytes] = []
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return first, b"".join(parts)
        data = await reader.readexactly(size + 2)
        if not first:
            first = time.perf_counter() - start
        parts.append(data[:-2])


async def stream_post(host: str, port: int, path: str, payload: object, timeout: float) -> Outcome:
    """POST ``payload`` as JSON to ``http://host:port/path`` (loopback only); time the first
    chunk of the body and its end. Never raises for the server's or the network's faults: an
    error, a status other than 200 or a timeout is the outcome's ``error``."""
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"stream_post: {host} is not a loopback address")
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    start = time.perf_counter()
    streams: list[asyncio.StreamWriter] = []

    async def exchange() -> tuple[int, float, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        streams.append(writer)
        writer.write(head + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            first, data = await _read_chunked(reader, start)
        else:
            data = await reader.read()
            first = time.perf_counter() - start
        return status, first, data

    try:
        status, first, data = await asyncio.wait_for(exchange(), timeout)
        total = time.perf_counter() - start
        error = "" if status == 200 else data[:200].decode("utf-8", "replace")
        return Outcome(first or total, total, status, error, data)
    except (OSError, asyncio.TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
        elapsed = time.perf_counter() - start
        return Outcome(elapsed, elapsed, 0, f"{type(exc).__name__}: {exc}")
    finally:
        for writer in streams:
            writer.close()


async def replay(
    requests: Sequence[Callable[[], Awaitable[Outcome]]], clients: int
) -> tuple[list[Outcome], float]:
    """Send ``requests`` in order with at most ``clients`` in flight; their outcomes (in the
    order given) and the wall seconds from the first send to the last reply."""
    if clients < 1:
        raise ValueError("replay: clients >= 1")
    outcomes: list[Outcome | None] = [None] * len(requests)
    queue = iter(range(len(requests)))

    async def client() -> None:
        for i in queue:
            outcomes[i] = await requests[i]()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(clients, len(requests)))))
    wall = time.perf_counter() - start
    return [o for o in outcomes if o is not None], wall


async def turns(
    rows: Sequence[tuple[str, Sequence[Callable[[], Awaitable[Outcome]]]]],
    clock: Callable[[], float] = time.perf_counter,
    seed: int = 0,
) -> dict[str, tuple[list[Outcome], float]]:
    """Every row's requests one at a time, the rows taking turns: request i of each row before
    request i + 1 of any, so that each row's i-th request meets the host as the others' did (at
    one client a row's p99 is close to its slowest request, and a shared host's speed drifts
    within seconds). The order of each turn cycles through every permutation of the rows (in
    a seeded order): each row goes first, and right after each other row, equally often; a
    request leaves work behind (a background save, a freed cache) that slows the one after it.
    Each row's outcomes (in its order) and the seconds its own requests took in all, by `clock`."""
    names = [name for name, _ in rows]
    if len(set(names)) != len(names):
        raise ValueError("turns: each row once")
    orders = list(itertools.permutations(range(len(rows))))
    random.Random(seed).shuffle(orders)
    done: dict[str, tuple[list[Outcome], float]] = {name: ([], 0.0) for name in names}
    for i in range(max((len(sends) for _, sends in rows), default=0)):
        for j in orders[i % len(orders)]:
            name, sends = rows[j]
            if i < len(sends):
                start = clock()
                outcome = await sends[i]()
                outcomes, seconds = done[name]
                outcomes.append(outcome)
                done[name] = (outcomes, seconds + clock() - start)
    return done


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux ``/proc``)."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    tree, queue = [], [pid]
    while queue:
        tree.append(queue.pop())
        queue.extend(_children(tree[-1]))
    return tree


def _pin(pids: Sequence[int], cpus: set[int]) -> None:
    """Every thread of the processes `pids` on `cpus` (threads and processes gone meanwhile skipped)."""
    for pid in pids:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def servers_on_one_core(servers: Sequence[int]) -> Iterator[int | None]:
    """Every thread of the process trees of `servers` (pids) on one CPU, the last this process
    may use, and this process and its other children (a store's master and holders) on the
    rest; each back on every CPU this process may use afterwards. At one client the towers of
    all rows then run on the same core: the rows compare the caches, not which core (of a
    shared host's, whose speeds differ) the scheduler kept a server on. Yields the CPU, or
    ``None`` where nothing moves (one CPU, or no ``sched_setaffinity``)."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        yield None
        return
    core = max(allowed)
    pinned = {pid for server in servers for pid in _tree(server)}
    _pin(sorted(pinned), {core})
    _pin([pid for pid in _tree(os.getpid()) if pid not in pinned], allowed - {core})
    try:
        yield core
    finally:  # the trees again: threads and children started meanwhile inherited the pinning
        _pin(sorted({*_tree(os.getpid()), *(pid for server in servers for pid in _tree(server))}), allowed)
