"""SGLang's own Mooncake embedding store against `MMKeyEmbeddingStore`, side by side in one run.

Run in SGLang's environment: ``.venv-sglang/bin/python benchmarks/bench_sglang.py [count]``.
Starts a local master and a separate segment holder on 127.0.0.1; both stores are pure
clients of it, created as SGLang creates them (SGLang's from ``MOONCAKE_*`` through
`EmbeddingStoreFactory`), each with one registered pool holding source and destination pages
of ``count`` embeddings of 1024 x 3584 bf16 (7 MiB each, default 64) laid out in SGLang's
36-token pages. Times (best of N, the two sides taking turns in every repetition, fresh
keys for every put; best of 1000 for lookups, whose medians are printed too):

- ``batch_is_exist`` of 64 hashes that exist, asked for the first time (mmkey's memory of
  recent yes answers cleared before each, outside the timing), and asked again within a
  second (mmkey answers from that memory; SGLang's asks the store again). Target <= 1.3x;
- paged put of ``count`` embeddings: SGLang's sends the pool pages themselves
  (``batch_put_from_multi_buffers``); mmkey's (by default, not in trusted-network mode)
  assembles each entry in its staging buffer (a header sealed over the pages: checksum, key,
  dtype, shape; then the pages copied) and writes it in a put session (start, ranged put,
  end), so that of several racing encoders exactly one writes;
- paged get of ``count`` embeddings (``batch_get_into_multi_buffers``): SGLang's land in
  the pages unverified; mmkey's land in its staging buffer, are verified (dtype, shape, key,
  checksum) and then copied into the pages. Target <= 1.3x.

Each side's read is checked against its source pool once, outside the timings.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

import torch

from _common import segment_holder
from mmkey import MooncakeConfig
from mmkey.testing.mooncake_master import running_master

MiB = 1 << 20
TOKENS, DIM, DTYPE = 1024, 3584, torch.bfloat16
PAGE_TOKENS = (256 << 10) // (DIM * 2)  # SGLang's compute_page_size: 36 tokens per page
STRIDE = -(-TOKENS // PAGE_TOKENS) * PAGE_TOKENS  # each embedding starts on a page boundary


class Side:
    """One store with one registered vision pool, its first half the source pages of every
    put and its second half the destination pages of every get."""

    def __init__(self, store: object, count: int) -> None:
        from sglang.srt.mem_cache.embedding_store import EmbeddingStore

        assert isinstance(store, EmbeddingStore)
        self.store = store
        self.count = count
        self.pool = torch.zeros(2 * count * STRIDE, DIM, dtype=DTYPE)
        self.src, self.dst = self.pool[: count * STRIDE], self.pool[count * STRIDE :]
        self.src.copy_(torch.randn(count * STRIDE, DIM))
        store.register_buffer(self.pool)
        row = DIM * self.src.element_size()
        self.sizes = [[TOKENS * row] for _ in range(count)]
        self.src_ptrs = [[self.src.data_ptr() + i * STRIDE * row] for i in range(count)]
        self.dst_ptrs = [[self.dst.data_ptr() + i * STRIDE * row] for i in range(count)]
        self.round = 0

    def hashes(self, round_: int) -> list[str]:
        return [str((round_ << 32) + i * 0x9E3779B1 % (1 << 32)) for i in range(self.count)]

    def put_fresh(self) -> None:
        self.round += 1
        ok = self.store.batch_put_from_multi_buffers(self.hashes(self.round), self.src_ptrs, self.sizes)
        assert all(ok), f"put failed: {ok.count(False)} of {len(ok)}"

    def get(self) -> None:
        ok = self.store.batch_get_into_multi_buffers(self.hashes(self.round), self.dst_ptrs, self.sizes)
        assert all(ok), f"get failed: {ok.count(False)} of {len(ok)}"

    def exist(self) -> None:
        assert all(self.store.batch_is_exist(self.hashes(self.round)[:64]))

    def forget(self) -> None:
        """Make the next lookup a first ask: mmkey's store forgets its recent yes answers."""
        recent = getattr(self.store, "_recent", None)
        if recent is not None:
            recent.clear()

    def check(self) -> None:
        self.dst.zero_()
        self.get()
        for i in range(self.count):
            rows = slice(i * STRIDE, i * STRIDE + TOKENS)
            assert torch.equal(self.dst[rows], self.src[rows]), f"embedding {i} differs"


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore")
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

    from mmkey.integrations.sglang import MMKeyEmbeddingStore

    with running_master() as master, segment_holder(master.address, "6GB"):
        os.environ.update(
            MOONCAKE_MASTER=master.address,
            MOONCAKE_GLOBAL_SEGMENT_SIZE="0",
            MOONCAKE_PROTOCOL="tcp",
            MOONCAKE_DEVICE="",
            MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE",
            MOONCAKE_LOCAL_HOSTNAME="127.0.0.1",
        )
        sglang_store = EmbeddingStoreFactory.create_backend("mooncake")
        mmkey_store = MMKeyEmbeddingStore(
            namespace="bench-model",
            config=MooncakeConfig(
                master_server_address=master.address,
                global_segment_size=0,
                local_buffer_size=256 * MiB,
                timeout=30.0,  # measures speed, not faults
            ),
        )
        try:
            sides = {"sglang": Side(sglang_store, count), "mmkey": Side(mmkey_store, count)}
            for side in sides.values():
                side.put_fresh()  # warm-up: connections, registrations, first allocations
                side.check()
            # the sides take turns within each repetition, so both see the same machine noise
            results: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
            for op, repeats in (("put", 3), ("get", 5), ("exist", 1000), ("again", 1000)):
                for _ in range(repeats):
                    for name, side in sides.items():
                        fn = {
                            "put": side.put_fresh,
                            "get": side.get,
                            "exist": side.exist,
                            "again": side.exist,
                        }[op]
                        if op == "exist":
                            side.forget()
                        start = time.perf_counter()
                        fn()
                        results[name].setdefault(op, []).append(time.perf_counter() - start)
                if op == "put":
                    for side in sides.values():
                        side.check()
            nbytes = count * TOKENS * DIM * 2
            print(
                f"{count} embeddings of {TOKENS} x {DIM} bf16 ({nbytes / MiB:.0f} MiB), "
                f"pages of {PAGE_TOKENS} tokens"
            )
            print(f"{'operation (ms; ratio mmkey/sglang)':44} {'sglang':>9} {'mmkey':>9} {'ratio':>7}")
            for op, label in (
                ("exist", f"batch_is_exist of {min(count, 64)}, first ask"),
                ("again", f"batch_is_exist of {min(count, 64)}, asked again"),
                ("put", f"paged put, {count} x 7 MiB"),
                ("get", f"paged get, {count} x 7 MiB (mmkey verified)"),
            ):
                s, m = min(results["sglang"][op]), min(results["mmkey"][op])
                best = " (best)" if op in ("exist", "again") else ""
                print(f"{label + best:44} {s * 1e3:9.2f} {m * 1e3:9.2f} {m / s:6.2f}x")
                if op in ("exist", "again"):
                    s, m = statistics.median(results["sglang"][op]), statistics.median(results["mmkey"][op])
                    print(f"{label + ' (median)':44} {s * 1e3:9.2f} {m * 1e3:9.2f} {m / s:6.2f}x")
            for op in ("put", "get"):
                s, m = min(results["sglang"][op]), min(results["mmkey"][op])
                print(f"{op} MiB/s{'':37} {nbytes / MiB / s:9.0f} {nbytes / MiB / m:9.0f}")
            print(f"mmkey stats: {mmkey_store.stats()}")
        finally:
            mmkey_store.close()
            sglang_store.store.close()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
