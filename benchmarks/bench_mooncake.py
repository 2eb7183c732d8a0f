"""MooncakeCache against the raw Mooncake binding, side by side in one run.

Run: ``python benchmarks/bench_mooncake.py``. Starts a local master and a separate segment
holder (``mooncake_client``) on 127.0.0.1, makes both sides pure clients of it, then
times each operation both ways (best of N) and prints the ratio adapter / raw:

- ``batch_is_exist`` of 1000 keys, key building included (raw: ``f"emb_{h}"`` strings,
  as one serving stack builds them; adapter: `EmbeddingKey` objects). Target <= 1.5x.
- ``get_embeddings`` of 256 x 64 KiB verified entries against raw ``get_batch`` plus
  ``torch.frombuffer``. Target <= 1.3x.
- The same read with entries signed with a fleet secret (`EntryKeyring`, every MAC
  verified) against the unsigned read. Target <= 1.5x.
- MiB/s writing and reading 64 KiB and 8 MiB entries: raw ``put``/``get`` of bytes in a
  loop against the adapter's batch calls (registered buffers, every entry verified).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator

import torch

from mmkey import (
    EmbeddingKey,
    EntryKeyring,
    HashScheme,
    Modality,
    MooncakeCache,
    MooncakeConfig,
    mm_hash,
)
from mmkey.testing.mooncake_master import running_master

MiB = 1 << 20
REPEATS = 7


def best(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def best_interleaved(a: Callable[[], object], b: Callable[[], object]) -> tuple[float, float]:
    """Best seconds of `a` and of `b`, timed in alternation so both see the same noise."""
    a(), b()
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(2 * REPEATS):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(times_a), min(times_b)


def row(name: str, raw: float, adapter: float, target: str = "") -> None:
    print(f"{name:46} {raw * 1e3:9.2f} {adapter * 1e3:9.2f} {adapter / raw:7.2f}x  {target}")


def rate_row(name: str, nbytes: int, raw: float, adapter: float) -> None:
    print(f"{name:46} {nbytes / MiB / raw:9.0f} {nbytes / MiB / adapter:9.0f} {raw / adapter:7.2f}x")


@contextlib.contextmanager
def segment_holder(master_address: str) -> Iterator[None]:
    """A standalone ``mooncake_client`` lending 2 GiB to the store, stopped by PID on exit."""
    binary = shutil.which("mooncake_client", path=os.path.dirname(sys.executable)) or "mooncake_client"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--host=127.0.0.1", "--global_segment_size=2GB", "--metadata_server=P2PHANDSHAKE",
         f"--master_server_address={master_address}", f"--port={port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(2.0)  # it mounts its segment with the master; the first put below checks it
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    from mooncake.store import MooncakeDistributedStore

    with running_master() as master, segment_holder(master.address):
        # both sides are pure clients (no segment of their own), as on a serving node: the
        # entries live in a separate segment-holder process, and every read crosses TCP
        raw = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 256 * MiB, "tcp", "", master.address) == 0
        config = MooncakeConfig(
            master_server_address=master.address,
            global_segment_size=0,
            local_buffer_size=256 * MiB,
            deadline=10.0,
        )
        cache = MooncakeCache(config, keyring=None)
        signed = MooncakeCache(config, keyring=EntryKeyring.from_secrets(b"benchmark secret, 32 bytes or more"))
        try:
            print(f"{'operation (ms; ratio adapter/raw)':46} {'raw':>9} {'mmkey':>9} {'ratio':>8}")
            digests = [mm_hash(i * 0x9E3779B97F4A7C15 % 2**128) for i in range(1000)]
            half = [EmbeddingKey("bench", Modality.IMAGE, HashScheme.BLAKE3, d) for d in digests[:500]]
            cache.insert_batch(half, [torch.ones(4)] * 500)
            raw.put_batch([f"emb_{d}" for d in digests[:500]], [b"x"] * 500)
            t_raw = best(lambda: raw.batch_is_exist([f"emb_{d}" for d in digests]))
            t_ada = best(
                lambda: cache.batch_is_exist(
                    EmbeddingKey.for_digests("bench", Modality.IMAGE, HashScheme.BLAKE3, digests)
                )
            )
            row("batch_is_exist, 1000 keys, keys built", t_raw, t_ada, "target <= 1.5x")
            built = EmbeddingKey.for_digests("bench", Modality.IMAGE, HashScheme.BLAKE3, digests)
            raw_texts = [f"emb_{d}" for d in digests]
            t_raw = best(lambda: raw.batch_is_exist(raw_texts))
            t_ada = best(lambda: cache.batch_is_exist(built))
            row("batch_is_exist, 1000 keys, keys prebuilt", t_raw, t_ada)

            tensors = [torch.randn(64 * 1024 // 4) for _ in range(256)]
            keys = [EmbeddingKey("bench64k", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i)) for i in range(256)]
            raw_keys = [f"raw64k_{i}" for i in range(256)]
            cache.insert_batch(keys, tensors)
            raw.put_batch(raw_keys, [t.numpy().tobytes() for t in tensors])

            def raw_get() -> list[torch.Tensor]:
                return [torch.frombuffer(b, dtype=torch.float32) for b in raw.get_batch(raw_keys)]

            t_raw = best(raw_get)
            t_ada = best(lambda: cache.get_embeddings(keys))
            row("get 256 x 64 KiB (verified vs get_batch)", t_raw, t_ada, "target <= 1.3x")

            signed_keys = EmbeddingKey.for_digests(
                "bench64k-signed", Modality.IMAGE, HashScheme.BLAKE3, [mm_hash(i) for i in range(256)]
            )
            signed.insert_batch(signed_keys, tensors)
            t_plain, t_signed = best_interleaved(
                lambda: cache.get_embeddings(keys), lambda: signed.get_embeddings(signed_keys)
            )
            print(f"\n{'authenticated (ms; ratio signed/unsigned)':46} {'unsigned':>9} {'signed':>9} {'ratio':>8}")
            row("get 256 x 64 KiB, every entry verified", t_plain, t_signed, "target <= 1.5x")
            t_plain, t_signed = best_interleaved(
                lambda: cache.insert_batch(keys, tensors),
                lambda: signed.insert_batch(signed_keys, tensors),
            )
            row("insert 256 x 64 KiB", t_plain, t_signed)

            print(f"\n{'throughput (MiB/s; speed-up mmkey/raw)':46} {'raw':>9} {'mmkey':>9} {'speedup':>8}")
            for size, count in ((64 * 1024, 256), (8 * MiB, 8)):
                ts = [torch.randn(size // 4) for _ in range(count)]
                blobs = [t.numpy().tobytes() for t in ts]
                ks = [EmbeddingKey(f"tp{size}", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i)) for i in range(count)]
                rk = [f"tp{size}_{i}" for i in range(count)]
                total = size * count
                t_raw = best(lambda: [raw.upsert(k, b) for k, b in zip(rk, blobs)], 3)
                t_ada = best(lambda: cache.insert_batch(ks, ts), 3)
                rate_row(f"write {size // 1024} KiB entries x {count}", total, t_raw, t_ada)
                t_raw = best(lambda: [torch.frombuffer(raw.get(k), dtype=torch.float32) for k in rk], 3)
                t_ada = best(lambda: cache.get_embeddings(ks), 3)
                rate_row(f"read {size // 1024} KiB entries x {count}", total, t_raw, t_ada)
            stats = cache.stats()
            print(f"\nadapter stats: hits={stats.hits} misses={stats.misses} corrupt={stats.corrupt} errors={stats.errors}")
            stats = signed.stats()
            print(f"signed stats: hits={stats.hits} misses={stats.misses} forged={stats.forged} corrupt={stats.corrupt}")
        finally:
            signed.close()
            cache.close()
            raw.close()


if __name__ == "__main__":
    main()
