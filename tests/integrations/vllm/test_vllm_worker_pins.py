"""Pins of the connector's worker side (`WorkerSide`) that the connector tests leave open
(found by a mutation pass): what a step's loads count, which saves are reported done to the
scheduler side, and a worker that saves nothing.

The worker side runs on a `MemoryCache` (no claims) or on the in-process fake Mooncake with
claims on; its saves are written on the saver's thread, so each test flushes them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from mmkey import (  # noqa: E402
    EmbeddingKey,
    HashScheme,
    MemoryCache,
    Modality,
    MooncakeCache,
    MooncakeConfig,
    identifier_digest,
)
from mmkey._log import Counters  # noqa: E402
from mmkey.integrations.vllm._metadata import LoadItem, MMKeyECMetadata, MMKeyECWorkerMetadata  # noqa: E402
from mmkey.integrations.vllm._worker import WorkerSide  # noqa: E402
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore  # noqa: E402

FLUSH_S = 10.0
"""How long a test waits for saves that must land (a hang guard, not a timing)."""


def key(name: str) -> EmbeddingKey:
    return EmbeddingKey("worker-pins", Modality.IMAGE, HashScheme.ID, identifier_digest(name))


def embedding(seed: int) -> torch.Tensor:
    return torch.randn(3, 16, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def no_warning(kind: str, message: str) -> None:
    raise AssertionError(f"unexpected warning: {kind}: {message}")


@pytest.fixture
def memory() -> Iterator[MemoryCache]:
    made = MemoryCache(16 << 20)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def claiming() -> Iterator[MooncakeCache]:
    """A cache with claims on, and a short ``claim_wait`` (any positive wait turns them on)."""
    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(
            master_server_address=master.address,
            global_segment_size=16 << 20,
            local_buffer_size=4 << 20,
            claim_wait=0.5,
        )
        with MooncakeCache(config, store_class=FakeMooncakeStore) as cache:
            yield cache


def saver(cache: MemoryCache | MooncakeCache, counts: Counters) -> WorkerSide:
    return WorkerSide(cache, 1 << 20, save=True, counts=counts, warn=no_warning)


def test_a_step_counts_each_item_it_loads_once(memory: MemoryCache) -> None:
    """``loaded`` counts the items a step put into the encoder cache, not those already there."""
    counts = Counters()
    worker = WorkerSide(memory, 1 << 20, save=False, counts=counts, warn=no_warning)
    meta = MMKeyECMetadata((LoadItem("a", embedding(1)), LoadItem("b", embedding(2))))
    encoder_cache = {"b": embedding(3)}
    worker.start_load_caches(meta, encoder_cache)
    assert torch.equal(encoder_cache["a"], embedding(1)) and torch.equal(encoder_cache["b"], embedding(3))
    assert counts.totals() == {"loaded": 1}
    worker.start_load_caches(MMKeyECMetadata((LoadItem("c", embedding(4)),)), encoder_cache)
    assert counts.totals() == {"loaded": 2}


def test_a_step_without_loads_or_metadata_touches_nothing(memory: MemoryCache) -> None:
    """No metadata (nothing bound) or a plan with no loads: the encoder cache is left as it is
    and nothing is counted."""
    counts = Counters()
    worker = WorkerSide(memory, 1 << 20, save=False, counts=counts, warn=no_warning)
    encoder_cache = {"x": embedding(5)}
    worker.start_load_caches(None, encoder_cache)
    worker.start_load_caches(MMKeyECMetadata(), encoder_cache)
    assert list(encoder_cache) == ["x"] and counts.totals() == {}


def test_a_worker_that_saves_nothing_has_nothing_to_flush_or_report(claiming: MooncakeCache) -> None:
    """A consumer's worker (no saver), even over a cache with claims: a flush is done at once,
    it reports no save, and a save asked of it is not counted."""
    counts = Counters()
    worker = WorkerSide(claiming, 1 << 20, save=False, counts=counts, warn=no_warning)
    try:
        assert worker.flush_saves(0.0) is True and worker.saver_counts() is None
        meta = MMKeyECMetadata(saves={"x": key("x")})
        worker.save_caches(meta, {"x": embedding(6)}, "x")
        assert worker.worker_meta() is None and counts.totals() == {}
    finally:
        worker.close()


def test_without_claims_no_save_is_reported_done(memory: MemoryCache) -> None:
    """Over a cache without claims the scheduler side holds none: no save, written or dropped,
    is reported to it."""
    counts = Counters()
    worker = saver(memory, counts)
    try:
        meta = MMKeyECMetadata(saves={"kept": key("kept"), "lost": key("lost")})
        worker.save_caches(meta, {"kept": embedding(7)}, "kept")
        worker.save_caches(meta, {}, "lost")  # planned, but the encoder cache lacks it
        assert worker.flush_saves(FLUSH_S)
        assert counts.totals() == {"saves": 1, "saves_dropped": 1}
        assert worker.worker_meta() is None
    finally:
        worker.close()


def test_with_claims_every_planned_save_is_reported_once_done(claiming: MooncakeCache) -> None:
    """With claims on (a half-second ``claim_wait`` too), each planned save is reported once it
    is written or dropped; an output the scheduler did not plan is dropped and not reported."""
    counts = Counters()
    worker = saver(claiming, counts)
    try:
        meta = MMKeyECMetadata(saves={"kept": key("kept"), "lost": key("lost")})
        worker.save_caches(meta, {"kept": embedding(8)}, "kept")
        worker.save_caches(meta, {}, "lost")
        worker.save_caches(meta, {"stray": embedding(9)}, "stray")  # not planned: no key
        assert worker.flush_saves(FLUSH_S)
        assert counts.totals() == {"saves": 1, "saves_dropped": 2}
        assert worker.worker_meta() == MMKeyECWorkerMetadata(
            frozenset({key("kept").to_key(), key("lost").to_key()})
        )
        assert worker.worker_meta() is None  # reported once
        assert claiming.batch_is_exist([key("kept"), key("lost")]) == [True, False]
    finally:
        worker.close()


class _MetaPlatform:
    """A stand-in for vLLM's ``current_platform`` whose device is PyTorch's ``meta`` device."""

    device_type = "meta"

    def is_cuda_alike(self) -> bool:
        return False


def test_loads_are_moved_to_the_platforms_device(
    memory: MemoryCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's staged tensors are put into the encoder cache on vLLM's current platform's
    device, not left where the scheduler side staged them."""
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "current_platform", _MetaPlatform(), raising=False)
    worker = WorkerSide(memory, 1 << 20, save=False, counts=Counters(), warn=no_warning)
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(MMKeyECMetadata((LoadItem("a", embedding(10)),)), encoder_cache)
    worker.start_load_caches(MMKeyECMetadata((LoadItem("b", embedding(11)),)), encoder_cache)
    assert encoder_cache["a"].device.type == "meta" and encoder_cache["b"].device.type == "meta"
    assert encoder_cache["a"].shape == embedding(10).shape


def test_with_claims_a_save_is_reported_only_once_written(
    claiming: MooncakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save under way is not reported done yet (its claim must hold until the entry lands);
    once written, it is."""
    entered, go = threading.Event(), threading.Event()
    real_insert = claiming.insert_batch

    def insert(keys: Any, tensors: Any) -> Any:
        entered.set()
        assert go.wait(FLUSH_S)
        return real_insert(keys, tensors)

    monkeypatch.setattr(claiming, "insert_batch", insert)
    worker = saver(claiming, Counters())
    try:
        worker.save_caches(MMKeyECMetadata(saves={"slow": key("slow")}), {"slow": embedding(12)}, "slow")
        assert entered.wait(FLUSH_S)
        assert worker.worker_meta() is None
        go.set()
        assert worker.flush_saves(FLUSH_S)
        assert worker.worker_meta() == MMKeyECWorkerMetadata(frozenset({key("slow").to_key()}))
    finally:
        go.set()
        worker.close()
