"""Where the time of one ``MooncakeCache.insert_batch`` goes, phase by phase, on a busy host.

Run: ``python benchmarks/trace_insert.py [--quiet]``. Starts a local master, loads the host
with `mmkey.testing.busy_host` (unless ``--quiet``), and for each staging size makes a
fresh cache and inserts 256 x 64 KiB twice, beside the raw binding's ``put_batch`` of the
same bytes. Each insert prints its phases (ms): construction, the caller's checks and
sizing, the hop to the lane (submit to start), the staging buffer's allocation and
registration, the lease, encoding (payload copies into staging, with the page faults the
lane thread took meanwhile), the binding's ``batch_upsert_from``, and the hop back (lane
done to caller awake), with the entries stored; also the caller's own phases (argument
checks, breaker and master ping, time after the wait) and garbage collections.

Measured 2026-12-01 (2 shared cores, 0.5 s timeout). Before: 0/256 stored in 8 of 10
inserts, each with encode = 475-700 ms (torch ``copy_`` of each 64 KiB payload waiting on its
OpenMP threads; 480-1800 page faults on a lane's first insert, staging allocated then) and
``batch_upsert_from`` 20-100 ms. After (staging faulted in at construction, one ``memmove``
per payload): 110 of 110 inserts stored everything; encode 3-57 ms, no page faults;
``batch_upsert_from`` 14-180 ms, as the raw binding's ``put_batch`` (13-137 ms) beside it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import resource
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

import mmkey.cache.mooncake._cache as mc
import mmkey.cache.mooncake._writes as writes
from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig, mm_hash
from mmkey.cache.mooncake import _staging as _mooncake_staging
from mmkey.cache.mooncake import _transport as _mooncake_transport
from mmkey.testing.busy_host import busy_host
from mmkey.testing.mooncake_master import running_master

MiB = 1 << 20
SIZES = (4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB)

_phases: dict[str, float] = {}
_lock = threading.Lock()


def _add(name: str, seconds: float) -> None:
    with _lock:
        _phases[name] = _phases.get(name, 0.0) + seconds


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _timed(name: str, fn: Callable[..., Any], *, faults: bool = False) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, before = time.perf_counter(), _faults() if faults else 0
        try:
            return fn(*args, **kwargs)
        finally:
            _add(name, time.perf_counter() - start)
            if faults:
                _add(name + " faults", _faults() - before)

    return wrapper


def _gc_timer(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _phases["gc started at"] = time.perf_counter()
    elif (started := _phases.pop("gc started at", None)) is not None:
        _add(f"gc gen{info['generation']}", time.perf_counter() - started)


def instrument() -> None:
    """Wrap the write path's phases with timers (this process only)."""
    gc.callbacks.append(_gc_timer)
    for owner, name, phase in (
        (writes, "encode_entry_into", "encode"),
        (writes, "stage_entry", "encode"),
        (writes.Writer, "flush_on_worker", "batch_upsert_from"),
        (_mooncake_staging.Staging, "view", "staging alloc+register"),
        (_mooncake_staging.Staging, "prepare", "staging alloc+register"),
        (_mooncake_transport.StoreTransport, "ready", "ready (breaker, master ping)"),
        (_mooncake_transport.StoreTransport, "master_answers", "master ping"),
        (mc, "insert_args", "argument checks"),
    ):
        if hasattr(owner, name):
            setattr(owner, name, _timed(phase, getattr(owner, name), faults=phase == "encode"))
    transport = _mooncake_transport.StoreTransport
    original_submit = transport.submit

    def submit(self: Any, lane: Any, fn: Callable[..., Any]) -> Any:
        queued = time.perf_counter()
        _add("before submit", queued - _phases.get("call start at", queued))

        def on_lane(store: Any, staging: Any) -> Any:
            _add("hop to lane", time.perf_counter() - queued)
            try:
                return fn(store, staging)
            finally:
                _phases["lane done at"] = time.perf_counter()

        return original_submit(self, lane, on_lane)

    # the timed stand-ins replace the transport's methods for this run
    transport.submit = submit  # type: ignore[method-assign]
    original_finish = transport.finish

    def finish(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_finish(self, *args, **kwargs)
        _phases["finished at"] = time.perf_counter()
        done = _phases.pop("lane done at", None)
        if done is not None:
            _add("hop back", time.perf_counter() - done)
        return result

    transport.finish = finish  # type: ignore[method-assign]


@contextmanager
def phases() -> Iterator[dict[str, float]]:
    _phases.clear()
    _phases["call start at"] = time.perf_counter()
    out: dict[str, float] = {}
    yield out
    end = time.perf_counter()
    finished = _phases.pop("finished at", None)
    if finished is not None:
        _add("after the wait", end - finished)
    _phases.pop("call start at", None)
    out.update(_phases)


def show(label: str, total: float, stored: int, got: dict[str, float]) -> None:
    for mark in ("lane done at", "finished at", "call start at", "gc started at"):
        got.pop(mark, None)  # points in time, not phases
    parts = [f"{k}={v * 1e3:.1f}" if "faults" not in k else f"{k}={v:.0f}" for k, v in got.items()]
    print(f"  {label:14} {stored:3}/256 in {total * 1e3:7.1f} ms | " + " ".join(parts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quiet", action="store_true", help="no background load")
    parser.add_argument("--timeout", type=float, default=0.5)
    parser.add_argument("--more", type=int, default=0, help="inserts after the second")
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    from mooncake.store import MooncakeDistributedStore

    instrument()
    tensors = [torch.randn(16 * 1024) for _ in range(256)]
    blobs = [t.numpy().tobytes() for t in tensors]
    load = nullcontext() if args.quiet else busy_host(600.0)
    with running_master() as master, load:
        raw = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 512 * MiB, 64 * MiB, "tcp", "", master.address) == 0
        try:
            for round_, size in enumerate(SIZES):
                config = MooncakeConfig(
                    master_server_address=master.address, local_buffer_size=size, timeout=args.timeout
                )
                start = time.perf_counter()
                with phases() as got:
                    cache = MooncakeCache(config, keyring=None)
                show("construct", time.perf_counter() - start, 0, got)
                try:
                    print(f"staging {size // MiB} MiB", flush=True)
                    for attempt in ("first", "second", *args.more * ("more",)):
                        keys = EmbeddingKey.for_digests(
                            f"trace{round_}{attempt}{time.perf_counter()}",
                            Modality.IMAGE,
                            HashScheme.BLAKE3,
                            [mm_hash(i) for i in range(256)],
                        )
                        start = time.perf_counter()
                        with phases() as got:
                            stored = sum(cache.insert_batch(keys, tensors))
                        total = time.perf_counter() - start
                        show(attempt, total, stored, got)
                    raw_keys = [f"raw{round_}_{i}" for i in range(256)]
                    start = time.perf_counter()
                    code = raw.put_batch(raw_keys, blobs)
                    print(
                        f"  {'raw put_batch':14} rc={code} in {(time.perf_counter() - start) * 1e3:7.1f} ms",
                        flush=True,
                    )
                finally:
                    cache.close()
        finally:
            raw.close()


if __name__ == "__main__":
    main()
