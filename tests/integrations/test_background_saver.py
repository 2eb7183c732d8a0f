"""`BackgroundSaver`: saves off the caller's thread, within a byte budget, failures counted.

The real caches are used where they can show the behaviour; a gated wrapper around a
`MemoryCache` holds a write open (the hung store itself is tested with a paused master in
tests/integrations/vllm/test_vllm_connector.py).
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch

from mmkey import CacheKey, EmbeddingKey, HashScheme, MemoryCache, Modality, identifier_digest
from mmkey.integrations import _background_saver as background_saver
from mmkey.integrations._background_saver import HOLD_POLL_S, MAX_HOLD_S, BackgroundSaver, SaverCounts
from tests._clock import FakeClock
from tests._support import wait_until


def key(name: str) -> EmbeddingKey:
    return EmbeddingKey("ns", Modality.IMAGE, HashScheme.ID, identifier_digest(name))


class GatedCache(MemoryCache):
    """A MemoryCache whose writes wait for `gate` (or raise when `fail` is set); `entered` is
    set once a write is waiting there."""

    def __init__(self) -> None:
        super().__init__(64 << 20)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = False
        self.batches: list[int] = []

    def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        self.entered.set()
        self.gate.wait(10)
        self.batches.append(len(keys))
        if self.fail:
            raise RuntimeError("store fault")
        return super().insert_batch(keys, embeddings)


def test_saves_land_in_the_cache() -> None:
    cache = MemoryCache(16 << 20)
    saver = BackgroundSaver(cache, 1 << 20)
    tensors = {f"i{n}": torch.randn(8, 16) for n in range(5)}
    for name, t in tensors.items():
        assert saver.submit(key(name), t)
    assert saver.flush(10)
    got = cache.get_embeddings([key(n) for n in tensors])
    assert all(g is not None and torch.equal(g, t) for g, t in zip(got, tensors.values(), strict=True))
    assert saver.counts() == SaverCounts(saved=5, failed=0, dropped=0, pending_bytes=0)
    assert saver.close(5)


def test_a_slow_store_never_blocks_submit_and_the_budget_drops_the_excess() -> None:
    cache = GatedCache()
    saver = BackgroundSaver(cache, 3 * 512)
    t = torch.zeros(8, 16, dtype=torch.float32)  # 512 bytes
    start = time.monotonic()
    results = [saver.submit(key(f"k{n}"), t) for n in range(6)]
    assert time.monotonic() - start < 1.0  # the write is held open the whole time
    assert results == [True, True, True, False, False, False]
    assert saver.counts().pending_bytes == 3 * 512 and saver.counts().dropped == 3
    assert not saver.flush(0.2)
    cache.gate.set()
    assert saver.flush(10)
    assert saver.counts().saved == 3 and saver.counts().pending_bytes == 0
    assert saver.submit(key("k9"), t) and saver.flush(10)  # budget freed
    saver.close(5)


def test_a_key_already_queued_is_queued_once_and_writes_are_batched() -> None:
    cache = GatedCache()
    saver = BackgroundSaver(cache, 1 << 20)
    t = torch.ones(4, 4)
    assert saver.submit(key("first"), t)
    assert cache.entered.wait(10)  # the saver thread took "first" and waits at the gate
    for name in ("a", "b", "a", "c"):
        assert saver.submit(key(name), t)
    cache.gate.set()
    assert saver.flush(10)
    assert cache.batches == [1, 3]
    saver.close(5)


def test_writes_are_split_to_fit_the_batch_budget() -> None:
    cache = GatedCache()
    saver = BackgroundSaver(cache, 1 << 20, max_batch_bytes=1024)
    t = torch.zeros(8, 16)  # 512 bytes
    saver.submit(key("first"), t)
    assert cache.entered.wait(10)
    big = torch.zeros(8, 64)  # 2 KiB: more than a batch alone
    for name, tensor in [("a", t), ("b", t), ("c", t), ("big", big), ("d", t)]:
        saver.submit(key(name), tensor)
    cache.gate.set()
    assert saver.flush(10)
    assert cache.batches == [1, 2, 1, 1, 1]
    assert saver.counts().saved == 6
    saver.close(5)


def test_a_failing_store_counts_failures_and_the_saver_keeps_going() -> None:
    cache = GatedCache()
    cache.gate.set()
    cache.fail = True
    messages: list[str] = []
    saver = BackgroundSaver(cache, 1 << 20, on_failure=messages.append)
    saver.submit(key("x"), torch.ones(2))
    assert saver.flush(10)
    assert saver.counts().failed == 1 and "RuntimeError: store fault" in messages[0]
    cache.fail = False
    saver.submit(key("y"), torch.ones(2))
    assert saver.flush(10) and saver.counts().saved == 1
    saver.close(5)


def test_tensors_are_released_once_written() -> None:
    saver = BackgroundSaver(MemoryCache(1 << 20), 1 << 20)
    t = torch.randn(16, 16)
    ref = weakref.ref(t)
    saver.submit(key("t"), t)
    assert saver.flush(10)
    del t
    gc.collect()
    assert ref() is None
    saver.close(5)


def test_close_drops_what_it_cannot_finish_and_refuses_more() -> None:
    cache = GatedCache()
    saver = BackgroundSaver(cache, 1 << 20)
    saver.submit(key("stuck"), torch.ones(2))
    assert cache.entered.wait(10)
    saver.submit(key("queued"), torch.ones(2))
    assert not saver.close(0.2)
    assert not saver.submit(key("late"), torch.ones(2))
    assert saver.counts().dropped == 2  # "queued" and "late"
    cache.gate.set()


@pytest.mark.parametrize(
    ("budget", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError)]
)
def test_budget_is_checked(budget: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        BackgroundSaver(MemoryCache(1 << 20), budget)  # type: ignore[arg-type]


def test_a_view_counts_the_storage_it_pins_and_stored_keys_are_skipped() -> None:
    cache = GatedCache()  # writes wait until the gate opens
    saver = BackgroundSaver(cache, 4096)
    whole = torch.zeros(64, 16)  # 4 KiB of storage
    assert saver.submit(key("view"), whole[:1])  # 64 B of data that pins all 4 KiB
    assert not saver.submit(key("other"), torch.zeros(1, 16))  # so the budget is full
    cache.gate.set()
    assert saver.flush(10)
    assert saver.submit(key("view"), whole[:1].clone())  # already stored: not written again
    assert saver.flush(10)
    counts = saver.counts()
    assert (counts.saved, counts.skipped, counts.dropped) == (1, 1, 1)
    assert cache.batches == [1]  # the second save made no write call
    assert saver.close(5)


def test_on_done_names_every_finished_save_before_a_flush_returns() -> None:
    """Written, skipped as stored, failed, and dropped at close: each is named once."""
    cache = GatedCache()
    cache.gate.set()
    done: list[str] = []
    saver = BackgroundSaver(cache, 1 << 20, on_done=done.extend)
    assert saver.submit(key("written"), torch.randn(2, 4))
    assert saver.flush(10)
    assert done == [key("written").to_key()]  # already there when the flush returned
    assert saver.submit(key("written"), torch.randn(2, 4))  # stored: skipped
    assert saver.flush(10)
    assert done[1:] == [key("written").to_key()]
    cache.fail = True
    assert saver.submit(key("failed"), torch.randn(2, 4))
    assert saver.flush(10)
    assert done[2:] == [key("failed").to_key()]
    cache.gate.clear()
    cache.entered.clear()
    assert saver.submit(key("held"), torch.randn(2, 4))
    assert cache.entered.wait(10)  # the thread is inside this write
    assert saver.submit(key("queued"), torch.randn(2, 4))
    assert not saver.close(0.05)
    assert key("queued").to_key() in done  # dropped at close
    cache.gate.set()


def test_a_held_save_waits_for_release_held_then_is_written() -> None:
    cache = GatedCache()
    cache.gate.set()
    clock = FakeClock()
    saver = BackgroundSaver(cache, 1 << 20, hold_s=MAX_HOLD_S, clock=clock)
    t = torch.ones(4, 4)
    assert saver.submit(key("a"), t)
    assert saver.counts().held == 1 and saver.counts().pending_bytes == t.nbytes
    # the thread looks at the clock every HOLD_POLL_S; with the clock stuck it never writes
    assert not cache.entered.wait(10 * HOLD_POLL_S)
    saver.release_held()
    assert wait_until(lambda: saver.counts().saved == 1, 10)
    assert saver.counts().held == 0 and cache.get_embeddings([key("a")])[0] is not None
    saver.close(5)


def test_release_held_lets_go_of_the_saves_queued_so_far_only() -> None:
    cache = MemoryCache(16 << 20)
    clock = FakeClock()
    saver = BackgroundSaver(cache, 1 << 20, hold_s=MAX_HOLD_S, clock=clock)
    assert saver.submit(key("early"), torch.ones(4, 4))
    saver.release_held()
    assert saver.submit(key("late"), torch.ones(4, 4))
    assert wait_until(lambda: saver.counts().saved == 1, 10)
    assert saver.counts().held == 1
    assert cache.batch_is_exist([key("early"), key("late")]) == [True, False]
    saver.close(5)


def test_a_held_save_is_written_once_its_hold_has_passed_without_release() -> None:
    cache = MemoryCache(16 << 20)
    clock = FakeClock()
    saver = BackgroundSaver(cache, 1 << 20, hold_s=0.5, clock=clock)
    assert saver.submit(key("a"), torch.ones(4, 4))
    clock.advance(0.49)
    assert saver.counts().held == 1  # not due yet (the thread may look meanwhile)
    clock.advance(0.02)  # its absolute bound: no release comes
    assert wait_until(lambda: saver.counts().saved == 1, 10)
    assert cache.batch_is_exist([key("a")]) == [True]
    saver.close(5)


def test_flush_and_close_write_held_saves() -> None:
    cache = MemoryCache(16 << 20)
    saver = BackgroundSaver(cache, 1 << 20, hold_s=MAX_HOLD_S, clock=FakeClock())
    assert saver.submit(key("a"), torch.ones(4, 4))
    assert saver.flush(10) and saver.counts().saved == 1
    assert saver.submit(key("b"), torch.ones(4, 4))
    assert saver.close(10) and cache.batch_is_exist([key("a"), key("b")]) == [True, True]


def test_without_a_hold_nothing_is_held() -> None:
    cache = GatedCache()
    saver = BackgroundSaver(cache, 1 << 20, clock=FakeClock())
    assert saver.submit(key("a"), torch.ones(4, 4))
    assert cache.entered.wait(10), "written at once, whatever the clock says"
    assert saver.counts().held == 0
    cache.gate.set()
    saver.close(5)


@pytest.mark.parametrize("hold", [-0.01, MAX_HOLD_S + 0.01, True, "0.1"])
def test_a_hold_out_of_range_is_refused(hold: object) -> None:
    with pytest.raises(ValueError, match=f"hold_s must be seconds within 0-{MAX_HOLD_S}"):
        BackgroundSaver(MemoryCache(1 << 20), 1 << 20, hold_s=hold)  # type: ignore[arg-type]


# -- pins found by mutation testing ---------------------------------------------------------


def test_a_new_saver_counts_nothing_and_has_nothing_to_flush() -> None:
    """Every count starts at zero, and with nothing queued or being written a flush is done at once."""
    saver = BackgroundSaver(MemoryCache(1 << 20), 1 << 20)
    assert saver.counts() == SaverCounts() == SaverCounts(0, 0, 0, 0, 0, 0)
    assert not hasattr(SaverCounts(), "__dict__")  # a slotted snapshot
    assert saver.flush(0)
    assert saver.close(5)


def test_a_budget_of_one_byte_takes_a_one_byte_save() -> None:
    cache = MemoryCache(1 << 20)
    saver = BackgroundSaver(cache, 1)
    assert not saver.submit(key("two"), torch.zeros(2, dtype=torch.uint8))
    assert saver.submit(key("one"), torch.zeros(1, dtype=torch.uint8))
    assert saver.flush(10) and saver.counts().saved == 1
    assert saver.close(5)


def test_the_saver_thread_is_a_named_daemon_that_close_ends() -> None:
    """An unclosed saver never keeps the interpreter alive; a closed one leaves no thread behind."""
    name = f"mmkey-saver-{uuid.uuid4().hex}"
    saver = BackgroundSaver(MemoryCache(1 << 20), 1 << 20, name=name)
    [thread] = [t for t in threading.enumerate() if t.name == name]
    assert thread.daemon
    assert saver.submit(key("a"), torch.ones(2))
    assert saver.close(10)
    assert not thread.is_alive()


def test_a_flush_shorter_than_a_second_waits_for_the_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its timeout bounds the wait: a short one is waited out, not given up on at once. (Time stands
    still for the flush here, so its deadline never passes: no bound on how fast the write is.)"""
    monkeypatch.setattr(background_saver, "time", SimpleNamespace(monotonic=FakeClock()))
    cache = GatedCache()
    saver = BackgroundSaver(cache, 1 << 20)
    assert saver.submit(key("a"), torch.ones(2))
    assert cache.entered.wait(10)  # being written
    cache.gate.set()
    assert saver.flush(0.5)
    assert saver.counts().saved == 1
    assert saver.close(5)
