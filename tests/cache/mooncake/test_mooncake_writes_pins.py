"""Writes on the fake store along the paths the other tests do not take: a staging buffer still
busy when a write's time runs out, a put from registered memory whose call ended while it
waited for staging, and the master failing a put session's start or an entry written alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, mm_hash
from mmkey.cache.mooncake import Added
from mmkey.cache.mooncake._writes import Writer
from mmkey.testing.fake_mooncake import RPC_FAIL, FakeMooncakeMaster, FakeMooncakeStore
from tests._clock import FakeClock
from tests._support import wait_until
from tests.cache.mooncake.pins_support import fake_config

MiB = 1 << 20


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("writes-pins", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


@pytest.fixture
def master() -> Iterator[FakeMooncakeMaster]:
    with FakeMooncakeMaster() as m:
        yield m


def make_cache(master: FakeMooncakeMaster, clock: FakeClock | None = None, **overrides: Any) -> MooncakeCache:
    config = fake_config(master, **overrides)
    if clock is None:
        return MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore)
    return MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore, clock=clock)


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


@pytest.mark.parametrize("registered", [False, True], ids=["staged", "from-registered-memory"])
def test_a_write_whose_staging_stays_busy_past_its_deadline_stores_nothing(
    master: FakeMooncakeMaster, registered: bool
) -> None:
    clock = FakeClock()  # never advanced: the write ends when its transfer gives up on the lease
    pool = torch.arange(64, dtype=torch.float32)
    with make_cache(master, clock, timeout=0.2, trusted_network=True) as cache:
        if registered:
            cache.register_memory(pool)
        leases = [lane.staging.lease for lane in cache._transport.lanes]
        for lease in leases:  # another caller still uses every lane's buffer
            assert lease.acquire(timeout=5)
        try:
            assert cache.insert_from([key(1)], [pool[:8]]) == [False]
        finally:
            for lease in leases:
                lease.release()
        assert master.keys() == []
        assert cache.insert_from([key(1)], [pool[:8]]) == [True]
        got = cache.get_embeddings([key(1)])[0]
        assert got is not None and torch.equal(got, pool[:8])


def test_a_put_from_registered_memory_whose_call_ended_while_it_waited_for_staging_sends_nothing(
    master: FakeMooncakeMaster,
) -> None:
    clock = FakeClock()
    pool = torch.arange(64, dtype=torch.float32)
    with make_cache(master, clock, timeout=10.0, trusted_network=True) as cache:
        cache.register_memory(pool)
        assert cache.insert_from([key(2)], [pool[:8]]) == [True]  # registered by now
        lanes = cache._transport.lanes
        gates = [GatedLease() for _ in lanes]
        for lane, gate in zip(lanes, gates, strict=True):
            lane.staging.lease = cast(Any, gate)
            gate.lock.acquire()
        stored: list[bool] = []
        writer = threading.Thread(target=lambda: stored.extend(cache.insert_from([key(3)], [pool[8:16]])))
        writer.start()
        try:
            assert wait_until(lambda: any(gate.entered.is_set() for gate in gates), 10)
            clock.advance(100.0)  # the call's time runs out while its put waits
            writer.join(10)
            assert stored == [False]
        finally:
            for gate in gates:
                gate.release()
            writer.join(10)
        assert wait_until(lambda: not any(lane.worker.is_busy() for lane in lanes), 10)
        assert master.calls["batch_put_from_multi_buffers"] == 1  # the first insert's only
        assert master.keys() == [key(2).to_key()]  # key 3 was not stored


def test_a_master_that_fails_a_put_sessions_start_opens_the_breaker(master: FakeMooncakeMaster) -> None:
    with make_cache(master) as cache:
        master.fail_next("batch_put_session_start", code=RPC_FAIL)
        assert cache.add_from([key(4)], [torch.ones(4)]) == [Added.FAILED]
        assert cache.health().breaker_open
        assert master.keys() == []


def test_a_master_that_fails_the_upsert_of_an_entry_larger_than_staging_opens_the_breaker(
    master: FakeMooncakeMaster,
) -> None:
    large = torch.ones(512 * 1024)  # 2 MiB: a buffer of its own
    with make_cache(master) as cache:
        master.fail_next("upsert_from", code=RPC_FAIL)
        assert cache.insert_batch([key(5)], [large]) == [False]
        assert cache.health().breaker_open
        assert cache.stats().errors >= 1


def test_puts_from_registered_memory_wait_while_writes_are_held(master: FakeMooncakeMaster) -> None:
    pool = torch.arange(64, dtype=torch.float32)
    with make_cache(master, trusted_network=True) as cache:
        cache.register_memory(pool)
        cache._transport.write_breaker.failure()  # as after a write that timed out
        assert cache.health().writes_held
        assert cache.insert_from([key(6)], [pool[:8]]) == [False]
        assert cache.add_from([key(7)], [pool[8:16]]) == [Added.FAILED]
        assert master.keys() == []
        assert cache.stats().skipped == 2


class NapClock:
    """A clock the writer reads and sleeps on: a sleep moves it on at once."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_reserved_keys_wait_may_take_up_to_half_the_calls_time(master: FakeMooncakeMaster) -> None:
    clock = NapClock()
    squatter = FakeMooncakeStore()
    assert squatter.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", master.address) == 0
    try:
        with make_cache(master, timeout=5.0) as cache:
            cache._writer = Writer(cache._parts, clock=clock, sleep=clock.sleep, reserved_wait=2.4)
            text = key(8).to_key()
            assert squatter.batch_put_session_start([text], [4096]) == [0]
            # 2.4 s of wait fit in half of the 5 s call: waited out, then written over
            assert cache.add_from([key(8)], [torch.ones(4)]) == [Added.STORED]
            assert clock.now == pytest.approx(102.4)
            assert cache.stats().squatted == 1
    finally:
        squatter.close()


def test_an_entry_larger_than_staging_is_written_with_every_replica(master: FakeMooncakeMaster) -> None:
    pytest.importorskip("mooncake.store")  # the cache's placement settings are the binding's class
    holders = [FakeMooncakeStore() for _ in range(2)]
    for holder in holders:
        assert holder.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", master.address) == 0
    large = torch.ones(512 * 1024)  # 2 MiB: a buffer of its own, past the 1 MiB staging
    try:
        with make_cache(master, global_segment_size=0, replica_num=2) as cache:
            assert cache.insert_batch([key(9)], [large]) == [True]
            placed = sorted(master.holders_of(key(9).to_key()))
            assert placed == sorted(holder.get_hostname() for holder in holders)
    finally:
        for holder in holders:
            holder.close()


def test_a_large_write_whose_buffer_cannot_be_registered_fails_alone_and_opens_no_breaker(
    master: FakeMooncakeMaster,
) -> None:
    large = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB: more than the staging buffer
    with make_cache(master) as cache:
        master.fail_next("register_buffer", code=-1)  # the buffer of its own, for this write alone
        assert cache.insert_batch([key(90), key(91)], [large, torch.ones(4)]) == [False, True]
        assert cache.stats().errors == 1
        assert not cache.health().breaker_open, "this client's memory, not the master"
        assert cache.insert_batch([key(90)], [large]) == [True]
        got = cache.get_embeddings([key(90)])[0]
        assert got is not None and torch.equal(got, large)
