"""The SGLang serving benchmark's arguments, counters and printout, without starting a server."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
bench: Any = importlib.import_module("bench_serve_sglang")
worker: Any = importlib.import_module("sglang_serve_worker")
loadgen: Any = importlib.import_module("loadgen")


def test_quick_runs_fewer_cells_and_unknown_rows_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    full = bench.parse_args([])
    assert (full.requests, full.clients, full.reuse, full.servers) == (96, "1,4,16", "0.5,0.8", 2)
    assert full.rows == "none,sglang,mmkey" and not full.no_fault
    quick = bench.parse_args(["--quick"])
    assert (quick.requests, quick.clients, quick.reuse) == (16, "1,16", "0.8")
    assert bench.parse_args(["--rows", "none,mmkey"]).rows == "none,mmkey"
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "none,vllm-store"])
    assert "unknown rows: vllm-store" in capsys.readouterr().err


def test_the_tower_is_sized_as_the_docs_say() -> None:
    assert bench.IMAGE_TOKENS == 144  # 336 px in 14 px patches, 2 x 2 merged
    assert bench.VISION["depth"] == 12 and bench.VISION["embed_dim"] == 384
    assert bench.VISION["embed_dim"] % bench.VISION["num_heads"] == 0


class _Grid:
    def __init__(self, rows: int) -> None:
        self.shape = (rows, 3)


class _Item:
    def __init__(self, rows: int | None) -> None:
        if rows is not None:
            self.image_grid_thw = _Grid(rows)


def test_the_tower_counter_counts_each_image_of_a_fused_batch() -> None:
    before = worker.counts()
    timed = worker._timed_tower(lambda items: len(items))
    assert timed([_Item(3), _Item(None)]) == 2
    after = worker.counts()
    assert after["tower_images"] - before["tower_images"] == 4  # 3 grids, and an item without one
    assert after["tower_s"] >= before["tower_s"]


class _Store:
    def batch_get_into_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        return [h != "miss" for h in hashes]

    def batch_put_from_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        return [True for _ in hashes]


class _Stats:
    waits_served, waits_timed_out, coalesced = 2, 1, 2


class _MMKeyStore(_Store):
    def stats(self) -> _Stats:
        return _Stats()


def test_the_counters_carry_a_stores_single_flight_counts() -> None:
    before = worker.counts()
    worker._counted_store(_MMKeyStore())
    after = worker.counts()
    assert after["waits_timed_out"] - before.get("waits_timed_out", 0.0) == 1
    assert after["coalesced"] - before.get("coalesced", 0.0) == 2


def test_the_store_counter_counts_what_landed() -> None:
    store = worker._counted_store(_Store())
    before = worker.counts()
    assert store.batch_get_into_multi_buffers(["a", "miss"], [[1], [2, 3]], [[10], [20, 30]]) == [True, False]
    assert store.batch_put_from_multi_buffers(["b"], [[1, 2]], [[5, 7]]) == [True]
    after = worker.counts()
    delta = {k: after[k] - before[k] for k in after}
    assert delta["loaded_items"] == 1 and delta["loaded_bytes"] == 10
    assert delta["saved_items"] == 1 and delta["saved_bytes"] == 12


def _cell(row: str, ms: list[float], counts: dict[str, float], clients: int = 16) -> Any:
    outcomes = [loadgen.Outcome(v / 1e3, v / 1e3, 200) for v in ms]
    return bench.Cell(row, 0.8, clients, outcomes, 1.0, counts)


def test_the_printout_names_sglang_the_encode_latency_and_the_targets() -> None:
    none = _cell("none", [200.0] * 10, {"tower_images": 10.0, "tower_s": 2.0})
    mmkey = _cell(
        "mmkey", [10.0] * 8 + [210.0, 210.0], {"tower_images": 2.0, "tower_s": 0.4, "loaded_bytes": 2 << 20}
    )
    paused = _cell("mmkey, store paused", [600.0] * 10, {"tower_images": 10.0, "waits_timed_out": 3.0})
    args = bench.parse_args([])
    hit = {"lookup": 0.2, "fetch": 0.4}
    report = bench.report_of([none, mmkey], paused, hit, 1.5, 3.0, args, "2026-12-04 07:30 UTC")
    text = bench.serve_tables.render(report, bench.IMAGE_TOKENS, "Qwen2-VL")
    assert text.startswith("benchmarks/bench_serve_sglang.py: 2 SGLang 0.5.23 encode servers")
    assert "run 2026-12-04 07:30 UTC, " in text and "load average up to 1.5 during the run, 3.0 min" in text
    assert "| configuration | requests/s | /encode p50 ms |" in text
    assert "| mmkey, 16 clients | 10.0 | 10.0 |" in text
    assert "| fetch + verify into pool pages (batch_get_into_multi_buffers) | 0.4 |" in text
    assert "| tower, per image (in the servers) | 200.0 |" in text
    assert "time-to-first-token stand-in" in text
    assert "single-flight, mmkey rows: 0 lookups waited" in text
    assert "single-flight, store paused: 0 lookups waited for an entry another server was encoding" in text
    assert "; 3 waited the whole claim wait and encoded" in text
    lines = bench.serve_tables.targets(report)
    assert lines[0] == "hit path <= 5% of the tower: 0.3% (met)"
    assert "95% below none (met)" in lines[1]
    assert "mmkey 210 ms, none 200 ms (missed)" in lines[2]
    assert lines[3] == "store paused, 16 clients: p99 600 ms, bound none p99 + 0.5 s = 700 ms (met)"


def test_every_seed_gets_a_picture_of_its_own(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    images = bench.Images(tmp_path)
    paths = [images(seed) for seed in (0, 256, 1000, 1256)]  # sglang_e2e.image repeats mod 256
    assert len({Path(p).read_bytes() for p in paths}) == 4
    assert images(256) == paths[1]  # made once
