"""Reads on the fake store along the paths the other tests do not take: a staging buffer still
busy when a read's time runs out, faults of an entry read alone (larger than a slot), and the
probe of a quarantined holder whose entry grew past the reader's bound."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig, mm_hash
from mmkey.entry.codec import encode_entry
from mmkey.testing.fake_mooncake import RPC_FAIL, TRANSFER_FAIL, FakeMooncakeMaster, FakeMooncakeStore
from tests._clock import FakeClock
from tests._support import wait_until
from tests.cache.mooncake.pins_support import fake_config

MiB = 1 << 20
LARGE = torch.arange(512 * 1024, dtype=torch.float32)
"""2 MiB of payload: larger than a 1 MiB staging buffer, so it is read alone."""


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("reads-pins", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


@pytest.fixture
def master() -> Iterator[FakeMooncakeMaster]:
    with FakeMooncakeMaster() as m:
        yield m


def config(master: FakeMooncakeMaster, **overrides: Any) -> MooncakeConfig:
    return fake_config(master, **overrides)


def idle(cache: MooncakeCache) -> bool:
    return not any(lane.worker.is_busy() for lane in cache._transport.lanes)


class GatedLease:
    """A staging lease that tells the test when a transfer starts waiting for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.entered.set()
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()


def test_a_read_whose_staging_stays_busy_past_its_deadline_is_a_counted_miss(
    master: FakeMooncakeMaster,
) -> None:
    clock = FakeClock()  # never advanced: the read ends when its transfer gives up on the lease
    with MooncakeCache(
        config(master, timeout=0.2), keyring=None, store_class=FakeMooncakeStore, clock=clock
    ) as cache:
        assert cache.insert_batch([key(1)], [torch.ones(4)]) == [True]
        leases = [lane.staging.lease for lane in cache._transport.lanes]
        for lease in leases:  # another caller still decodes in every lane's buffer
            assert lease.acquire(timeout=5)
        try:
            assert cache.get_embeddings([key(1)]) == [None]
        finally:
            for lease in leases:
                lease.release()
        assert master.calls["batch_get_into"] == 0  # the buffer was never written over
        assert cache.stats().errors == 1
        got = cache.get_embeddings([key(1)])[0]
        assert got is not None and torch.equal(got, torch.ones(4))


def test_a_transfer_whose_call_ended_while_it_waited_for_staging_moves_nothing(
    master: FakeMooncakeMaster,
) -> None:
    clock = FakeClock()
    with MooncakeCache(
        config(master, timeout=10.0), keyring=None, store_class=FakeMooncakeStore, clock=clock
    ) as cache:
        assert cache.insert_batch([key(2)], [torch.ones(4)]) == [True]
        gates = [GatedLease() for _ in cache._transport.lanes]
        for lane, gate in zip(cache._transport.lanes, gates, strict=True):
            lane.staging.lease = cast(Any, gate)
            gate.lock.acquire()
        got: list[torch.Tensor | None] = []
        reader = threading.Thread(target=lambda: got.extend(cache.get_embeddings([key(2)])))
        reader.start()
        try:
            assert wait_until(lambda: any(gate.entered.is_set() for gate in gates), 10)
            clock.advance(100.0)  # the call's time runs out while its transfer waits
            reader.join(10)
            assert got == [None]
        finally:
            for gate in gates:
                gate.release()
            reader.join(10)
        assert wait_until(lambda: idle(cache), 10)
        assert master.calls["batch_get_into"] == 0
        assert not any(gate.lock.locked() for gate in gates)


@pytest.mark.parametrize(
    ("method", "code"),
    [("get_size", RPC_FAIL), ("get_into", RPC_FAIL)],
    ids=["size", "read"],
)
def test_a_master_fault_reading_a_large_entry_opens_the_breaker(
    master: FakeMooncakeMaster, method: str, code: int
) -> None:
    with MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore) as cache:
        assert cache.insert_batch([key(3)], [LARGE]) == [True]
        master.fail_next(method, code=code)
        assert cache.get_embeddings([key(3)]) == [None]
        assert cache.health().breaker_open
        assert cache.stats().errors == 1


def test_a_failed_transfer_of_a_large_entry_quarantines_its_holder(master: FakeMooncakeMaster) -> None:
    with MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore) as cache:
        assert cache.insert_batch([key(4)], [LARGE]) == [True]
        master.fail_next("get_into", code=TRANSFER_FAIL)
        assert cache.get_embeddings([key(4)]) == [None]
        assert cache.stats().errors == 1
        assert not cache.health().breaker_open  # a holder's fault, not the master's
        assert wait_until(lambda: len(cache.health().quarantined) == 1, 10)


def test_an_entry_too_large_to_allocate_is_one_counted_error(master: FakeMooncakeMaster) -> None:
    huge = 1 << 49  # within the bound below, beyond any allocation

    class HugeEntries(FakeMooncakeStore):
        def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
            return [-600] * len(keys)  # every entry larger than its slot

        def get_size(self, key: str, /) -> int:
            return huge

    with MooncakeCache(
        config(master, max_entry_size=2 * huge), keyring=None, store_class=HugeEntries
    ) as cache:
        assert cache.get_embeddings([key(5)]) == [None]
        stats = cache.stats()
        assert (stats.errors, stats.oversized, stats.misses) == (1, 0, 1)


def test_a_quarantined_holder_whose_entry_outgrew_the_bound_stays_quarantined(
    master: FakeMooncakeMaster,
) -> None:
    holder = FakeMooncakeStore()
    assert holder.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", master.address) == 0
    endpoint = holder.get_hostname()
    text = key(6).to_key()
    try:
        assert holder.upsert(text, encode_entry(text, torch.ones(4))) == 0
        settings = config(master, global_segment_size=0, retry_after=0.05, max_entry_size=64 * 1024)
        with MooncakeCache(settings, keyring=None, store_class=FakeMooncakeStore) as cache:
            master.make_unreachable(endpoint)
            assert cache.get_embeddings([key(6)]) == [None]
            assert wait_until(lambda: cache.health().quarantined == (endpoint,), 10)
            master.make_unreachable(endpoint, False)
            # the holder answers again, but its entry is now larger than any read may fetch
            assert holder.upsert(text, encode_entry(text, torch.ones(256 * 1024))) == 0

            def probed() -> bool:  # a read while quarantined is a miss; one of them sends the probe
                return cache.get_embeddings([key(6)]) == [None] and master.calls["get_size"] >= 1

            assert wait_until(probed, 10)
            assert wait_until(lambda: not cache._transport._prober.is_busy(), 10)
            assert cache.health().quarantined == (endpoint,)
            assert master.calls["get_into"] == 0
    finally:
        holder.close()


def test_read_into_teaches_the_read_slot_only_entries_that_verified(master: FakeMooncakeMaster) -> None:
    with MooncakeCache(
        config(master, local_buffer_size=8 * MiB), keyring=None, store_class=FakeMooncakeStore
    ) as cache:
        slots = cache._transport.lanes[0].staging.slots
        first = slots.slot
        assert cache.insert_batch([key(7), key(8)], [LARGE, LARGE]) == [True, True]
        master.flip_byte(key(7).to_key(), offset=-3)  # a payload byte: it no longer verifies
        assert cache.read_into([key(7)], [torch.zeros_like(LARGE)]) == [False]
        assert slots.slot == first  # a refused entry teaches nothing
        target = torch.zeros_like(LARGE)
        assert cache.read_into([key(8)], [target]) == [True]
        assert torch.equal(target, LARGE)
        assert slots.slot > LARGE.nbytes  # grown to the entry that verified


def test_reads_bound_for_a_holder_still_quarantined_long_after_its_failure_are_not_transferred(
    master: FakeMooncakeMaster,
) -> None:
    holder = FakeMooncakeStore()
    assert holder.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", master.address) == 0
    endpoint = holder.get_hostname()
    text = key(9).to_key()
    clock = FakeClock()
    try:
        assert holder.upsert(text, encode_entry(text, torch.ones(4))) == 0
        settings = config(master, global_segment_size=0)
        with MooncakeCache(settings, keyring=None, store_class=FakeMooncakeStore, clock=clock) as cache:
            master.make_unreachable(endpoint)
            assert cache.get_embeddings([key(9)]) == [None]
            assert wait_until(lambda: cache.health().quarantined == (endpoint,), 10)
            clock.advance(120.0)  # long past the last failure; the holder still fails its probes
            transfers = master.calls["batch_get_into"]
            assert cache.get_embeddings([key(9)]) == [None]
            assert master.calls["batch_get_into"] == transfers  # a miss at once, as quarantined
            assert cache.health().quarantined == (endpoint,)
    finally:
        holder.close()


def test_a_large_entry_that_did_not_verify_leaves_the_read_slot_as_it_was(master: FakeMooncakeMaster) -> None:
    with MooncakeCache(
        config(master, local_buffer_size=4 * MiB), keyring=None, store_class=FakeMooncakeStore
    ) as cache:
        slots = cache._transport.lanes[0].staging.slots
        huge = torch.ones(2 * MiB)  # 8 MiB: read alone, past the 4 MiB buffer
        assert cache.insert_batch([key(10), key(11)], [LARGE, huge]) == [True, True]
        got = cache.get_embeddings([key(10)])[0]
        assert got is not None and torch.equal(got, LARGE)
        learned = slots.slot
        assert learned > LARGE.nbytes
        master.flip_byte(key(11).to_key(), offset=-3)
        assert cache.get_embeddings([key(11)]) == [None]
        assert master.calls["get_into"] == 1  # read alone, then refused
        assert slots.slot == learned


def test_no_entry_is_read_alone_once_the_calls_time_ran_out(master: FakeMooncakeMaster) -> None:
    clock = FakeClock()

    class SlowAnswer(FakeMooncakeStore):
        def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
            clock.advance(10.0)  # the batch takes the call's whole time
            return [-600] * len(keys)  # every entry larger than its slot

    with MooncakeCache(config(master), keyring=None, store_class=SlowAnswer, clock=clock) as cache:
        assert cache.insert_batch([key(12)], [LARGE]) == [True]
        assert cache.get_embeddings([key(12)]) == [None]
        assert master.calls["get_size"] == 0
        assert cache.stats().errors == 0
        assert wait_until(lambda: idle(cache), 10)


def test_a_read_that_finds_nothing_leaves_the_read_slot_as_it_was(master: FakeMooncakeMaster) -> None:
    with MooncakeCache(
        config(master, local_buffer_size=8 * MiB), keyring=None, store_class=FakeMooncakeStore
    ) as cache:
        slots = cache._transport.lanes[0].staging.slots
        assert cache.insert_batch([key(13)], [LARGE]) == [True]
        assert cache.get_embeddings([key(13)])[0] is not None
        learned = slots.slot
        assert learned > LARGE.nbytes
        assert cache.get_embeddings([key(14), key(15)]) == [None, None]  # misses: nothing to learn
        assert slots.slot == learned


def test_a_large_entry_whose_buffer_cannot_be_registered_is_a_counted_miss(
    master: FakeMooncakeMaster,
) -> None:
    with MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore) as cache:
        assert cache.insert_batch([key(16)], [LARGE]) == [True]
        assert cache.insert_batch([key(99)], [torch.ones(4)]) == [True]
        master.fail_next("register_buffer", code=-1)  # the buffer of its own, for the read alone
        got = cache.get_embeddings([key(16), key(99)])
        assert got[0] is None and got[1] is not None, "the other entry of the call is read"
        assert cache.stats().errors == 1
        assert master.calls["get_into"] == 0  # never read into memory the store does not know
        # this client's memory, not the master: no breaker, the next read is served
        assert not cache.health().breaker_open
        again = cache.get_embeddings([key(16)])[0]
        assert again is not None and torch.equal(again, LARGE)


def test_a_failed_transfer_quarantines_no_holder_while_the_master_is_silent(
    master: FakeMooncakeMaster,
) -> None:
    with MooncakeCache(config(master, timeout=0.5), keyring=None, store_class=FakeMooncakeStore) as cache:
        assert cache.insert_batch([key(17)], [torch.ones(4)]) == [True]
        master.delay("ping", 2.0)  # the master stops answering its liveness probe
        master.fail_next("batch_get_into", code=TRANSFER_FAIL)
        assert cache.get_embeddings([key(17)]) == [None]
        # the lookup that would name the holder gives up on the silent master
        assert wait_until(lambda: not cache._transport._meta.is_busy(), 10)
        master.delay("ping", 0)
        assert cache.health().quarantined == ()


def test_a_read_with_every_lane_stuck_is_a_counted_skip(master: FakeMooncakeMaster) -> None:
    clock = FakeClock()
    with MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore, clock=clock) as cache:
        assert cache.insert_batch([key(18)], [torch.ones(4)]) == [True]
        release = threading.Event()
        started = [threading.Event() for _ in cache._transport.lanes]

        def hold(entered: threading.Event) -> None:
            entered.set()
            release.wait(30)

        for lane, entered in zip(cache._transport.lanes, started, strict=True):
            lane.worker.submit(functools.partial(hold, entered))
        try:
            assert all(entered.wait(10) for entered in started)
            clock.advance(10.0)  # each lane's call has run past the timeout: stuck
            assert cache.get_embeddings([key(18)]) == [None]
            stats = cache.stats()
            assert (stats.skipped, stats.errors) == (1, 0)
            assert master.calls["batch_get_into"] == 0
        finally:
            release.set()


def test_a_one_byte_value_under_a_key_is_read_and_refused_as_corrupt(master: FakeMooncakeMaster) -> None:
    with MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore) as cache:
        stranger = FakeMooncakeStore()
        assert stranger.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 * MiB, "tcp", "", master.address) == 0
        try:
            assert stranger.upsert(key(19).to_key(), b"J") == 0
            assert cache.get_embeddings([key(19)]) == [None]
            assert cache.stats().corrupt == 1
        finally:
            stranger.close()


def test_a_value_read_alone_that_shrank_to_one_byte_is_read_and_refused(master: FakeMooncakeMaster) -> None:
    class TooSmallFirst(FakeMooncakeStore):
        def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
            return [-600] * len(keys)  # larger than its slot when the batch ran; replaced since

    with MooncakeCache(config(master), keyring=None, store_class=TooSmallFirst) as cache:
        assert cache.insert_batch([key(20)], [torch.ones(4)]) == [True]
        stranger = FakeMooncakeStore()
        assert stranger.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 * MiB, "tcp", "", master.address) == 0
        try:
            assert stranger.upsert(key(20).to_key(), b"J") == 0
            assert cache.get_embeddings([key(20)]) == [None]
            assert cache.stats().corrupt == 1
            assert master.calls["get_into"] == 1
        finally:
            stranger.close()


def test_a_quarantined_holder_whose_one_byte_value_reads_back_is_readmitted(
    master: FakeMooncakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    holder = FakeMooncakeStore()
    assert holder.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", master.address) == 0
    endpoint = holder.get_hostname()
    text = key(21).to_key()
    caplog.set_level(logging.WARNING, logger="mmkey.cache.mooncake")
    try:
        assert holder.upsert(text, b"J") == 0  # any value the master lists there will do
        settings = config(master, global_segment_size=0, retry_after=0.05)
        with MooncakeCache(settings, keyring=None, store_class=FakeMooncakeStore) as cache:
            master.make_unreachable(endpoint)
            assert cache.get_embeddings([key(21)]) == [None]
            assert wait_until(lambda: cache.health().quarantined == (endpoint,), 10)
            assert any(f"{endpoint} quarantined: a transfer failed" in m for m in caplog.messages)
            master.make_unreachable(endpoint, False)

            def readmitted() -> bool:
                cache.get_embeddings([key(21)])
                return cache.health().quarantined == ()

            assert wait_until(readmitted, 10)
    finally:
        holder.close()
