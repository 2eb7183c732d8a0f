"""Faults of `MooncakeCache` on the fake store, timed by a fake clock: no test here sleeps.

A hung binding call advances the cache's clock past the call's give-up time and then blocks
until the test lets it go, so the cut-off, the stuck lane and the breaker's wait are all told
by the clock, never by the wall (the real-master tests in test_mooncake_cache.py and
test_mooncake_edges.py keep the promise honest in real time).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig, mm_hash
from mmkey.cache.health import CacheHealth
from mmkey.cache.mooncake._transport import RETRY_BACKOFF
from mmkey.cache.protocol import Claim
from mmkey.entry.codec import encode_entry
from mmkey.testing.fake_mooncake import RPC_FAIL, FakeMooncakeMaster, FakeMooncakeStore
from tests._clock import FakeClock
from tests._support import wait_until

MiB = 1 << 20
TIMEOUT = 2.0
RETRY_AFTER = 30.0
HUNG_FOR = 100.0
"""How far the clock moves on while a call hangs: well past any timeout here."""


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("clock-model", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


class Hangs:
    """Binding methods made to hang: the first call of each after `hang` moves the clock
    `HUNG_FOR` s (or the seconds `hang` was given) on, then blocks until `release`."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._gates: dict[str, threading.Event] = {}
        self._earlier: list[threading.Event] = []  # gates of calls hung before a method's last `hang`
        self._for: dict[str, float] = {}
        self.entered: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def hang(self, method: str, seconds: float = HUNG_FOR) -> None:
        with self._lock:
            if method in self._gates:
                self._earlier.append(self._gates[method])
            self._gates[method] = threading.Event()
            self._for[method] = seconds
            self.entered[method] = threading.Event()

    def release(self) -> None:
        with self._lock:
            gates, self._gates, self._earlier = [*self._gates.values(), *self._earlier], {}, []
        for gate in gates:
            gate.set()

    def enter(self, method: str) -> None:
        with self._lock:
            gate = self._gates.get(method)
            entered = self.entered.get(method)
            if gate is None or entered is None or entered.is_set():  # only its first call hangs
                return
            entered.set()
            seconds = self._for[method]
        self.clock.advance(seconds)
        assert gate.wait(30), "the test never released a hung call"


def store_class(hangs: Hangs) -> type[FakeMooncakeStore]:
    class HangingStore(FakeMooncakeStore):
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            hangs.enter("batch_is_exist")
            return super().batch_is_exist(keys)

        def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
            hangs.enter("batch_get_into")
            return super().batch_get_into(keys, buffer_ptrs, sizes)

        def batch_upsert_from(
            self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], *rest: Any
        ) -> list[int]:
            hangs.enter("batch_upsert_from")
            return super().batch_upsert_from(keys, buffer_ptrs, sizes, *rest)

        def batch_put_from_multi_buffers(
            self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]], *rest: Any
        ) -> list[int]:
            hangs.enter("batch_put_from_multi_buffers")
            return super().batch_put_from_multi_buffers(keys, all_buffer_ptrs, all_sizes, *rest)

        def batch_put_session_start(self, keys: list[str], sizes: list[int], *rest: Any) -> list[int]:
            hangs.enter("batch_put_session_start")
            return super().batch_put_session_start(keys, sizes, *rest)

    return HangingStore


@pytest.fixture
def master() -> Iterator[FakeMooncakeMaster]:
    with FakeMooncakeMaster() as m:
        yield m


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def hangs(clock: FakeClock) -> Iterator[Hangs]:
    h = Hangs(clock)
    yield h
    h.release()


def settings(master: FakeMooncakeMaster, **overrides: Any) -> MooncakeConfig:
    """A pure client of `master` with this module's timeout and breaker wait."""
    fields: dict[str, Any] = {
        "master_server_address": master.address,
        "global_segment_size": 0,
        "local_buffer_size": 8 * MiB,
        "timeout": TIMEOUT,
        "retry_after": RETRY_AFTER,
    }
    return MooncakeConfig(**{**fields, **overrides})


@pytest.fixture
def cache(master: FakeMooncakeMaster, clock: FakeClock, hangs: Hangs) -> Iterator[MooncakeCache]:
    config = settings(master)
    with MooncakeCache(config, keyring=None, store_class=store_class(hangs), clock=clock) as c:
        yield c
    hangs.release()


def a_holder(master: FakeMooncakeMaster) -> FakeMooncakeStore:
    """A segment holder beside the cache (the cache itself lends no memory)."""
    store = FakeMooncakeStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", master.address) == 0
    return store


@pytest.fixture
def holder(master: FakeMooncakeMaster) -> Iterator[FakeMooncakeStore]:
    store = a_holder(master)
    yield store
    store.close()


def put(holder: FakeMooncakeStore, k: EmbeddingKey, tensor: torch.Tensor) -> None:
    assert holder.upsert(k.to_key(), encode_entry(k.to_key(), tensor)) == 0


def test_a_hung_lookup_is_a_miss_at_its_give_up_time_and_its_lane_is_stuck_by_the_clock(
    cache: MooncakeCache,
    master: FakeMooncakeMaster,
    holder: FakeMooncakeStore,
    clock: FakeClock,
    hangs: Hangs,
) -> None:
    put(holder, key(1), torch.ones(4))
    assert cache.batch_is_exist([key(1)]) == [True]  # the control
    hangs.hang("batch_is_exist")
    before = clock()
    assert cache.batch_is_exist([key(1)]) == [False]
    assert clock() - before == HUNG_FOR, "cut off by the clock the call moved, not by the wall"
    assert cache.stats().errors == 1
    assert cache.health() == CacheHealth(breaker_open=True, busy_lanes=1)
    calls = master.calls["batch_is_exist"]
    assert cache.batch_is_exist([key(1)]) == [False]  # the lane is stuck: answered at once
    assert master.calls["batch_is_exist"] == calls and cache.stats().skipped == 1
    hangs.release()
    assert wait_until(lambda: cache.health().busy_lanes == 0, 10)  # the call ended: the lane is free
    assert cache.batch_is_exist([key(1)]) == [False], "the breaker still refuses"
    clock.advance(RETRY_AFTER)
    assert cache.batch_is_exist([key(1)]) == [True], "one trial once retry_after passed, by the clock"
    assert cache.health() == CacheHealth()


def test_a_hung_transfer_is_a_miss_at_its_give_up_time_and_a_late_answer_frees_the_lane(
    cache: MooncakeCache, holder: FakeMooncakeStore, clock: FakeClock, hangs: Hangs
) -> None:
    put(holder, key(2), torch.ones(4))
    hangs.hang("batch_get_into")
    assert cache.get_embeddings([key(2)]) == [None]
    stats = cache.stats()
    assert (stats.errors, stats.misses) == (1, 1)
    assert cache.health().busy_lanes == 1, "stuck past the timeout, by the clock"
    hangs.release()
    # the late transfer lands in staging only, frees its lane and clears its holder
    assert wait_until(lambda: cache.health() == CacheHealth(), 10), cache.health()
    got = cache.get_embeddings([key(2)])[0]
    assert got is not None and torch.equal(got, torch.ones(4))


def test_a_read_from_another_holder_goes_to_another_lane_than_the_stuck_one(
    cache: MooncakeCache, master: FakeMooncakeMaster, holder: FakeMooncakeStore, hangs: Hangs
) -> None:
    other = a_holder(master)
    try:
        put(holder, key(3), torch.ones(4))
        put(other, key(4), torch.full((4,), 2.0))
        hangs.hang("batch_get_into")
        assert cache.get_embeddings([key(3)]) == [None]
        # the holder that hung is found on the metadata lane (in the background) and quarantined
        assert wait_until(lambda: cache.health().quarantined == (holder.get_hostname(),), 10)
        got = cache.get_embeddings([key(4)])[0]  # the next lane: no wait behind the stuck one
        assert got is not None and torch.equal(got, torch.full((4,), 2.0))
        assert cache.health().busy_lanes == 1
        assert cache.get_embeddings([key(3)]) == [None]  # bound for the quarantined holder
        assert cache.stats().skipped == 1
    finally:
        hangs.release()
        other.close()


def test_a_hung_write_is_false_at_its_give_up_time_and_the_breaker_waits_by_the_clock(
    cache: MooncakeCache,
    master: FakeMooncakeMaster,
    clock: FakeClock,
    hangs: Hangs,
    holder: FakeMooncakeStore,
) -> None:
    hangs.hang("batch_upsert_from")
    assert cache.insert_batch([key(5)], [torch.ones(4)]) == [False]
    assert cache.stats().errors == 1 and cache.stats().inserts == 0
    hangs.release()
    assert wait_until(lambda: cache.health().busy_lanes == 0, 10)
    master.fail_next("batch_is_exist", code=RPC_FAIL)
    assert cache.batch_is_exist([key(5)]) == [False]
    assert cache.health().breaker_open
    clock.advance(RETRY_AFTER - 1.0)
    calls = sum(master.calls.values())
    assert cache.insert_batch([key(5)], [torch.ones(4)]) == [False]  # refused, the store not asked
    assert sum(master.calls.values()) == calls
    clock.advance(1.0)
    assert cache.insert_batch([key(5)], [torch.ones(4)]) == [True]
    assert not cache.health().breaker_open


def test_a_reconnect_waits_at_most_the_call_timeout_not_the_setup_timeout(
    master: FakeMooncakeMaster, clock: FakeClock, holder: FakeMooncakeStore
) -> None:
    # the master is down at construction, then answers its port but sets clients up slowly
    # (as a hung master does): a lookup still answers at its own give-up time, not at
    # `setup_timeout`'s; the slow setup finishes on the metadata lane and the cache recovers
    setup_s = TIMEOUT + 0.5  # past the call's timeout, within the setup timeout
    entered, gate = threading.Event(), threading.Event()

    class SlowSetup(FakeMooncakeStore):
        def setup(self, *args: Any, **kwargs: Any) -> int:
            if not entered.is_set():
                entered.set()
                clock.advance(setup_s)
                assert gate.wait(30), "the test never let the slow setup go"
            return super().setup(*args, **kwargs)

    master.kill()
    config = MooncakeConfig(
        master_server_address=master.address,
        global_segment_size=0,
        local_buffer_size=8 * MiB,
        timeout=TIMEOUT,
        setup_timeout=2 * setup_s,
        retry_after=RETRY_AFTER,
    )
    with MooncakeCache(config, keyring=None, store_class=SlowSetup, clock=clock) as c:
        try:
            assert not c.is_connected() and not entered.is_set()
            master.restart()
            clock.advance(RETRY_AFTER)  # past retry_after: the next call sets the store up
            before = clock()
            assert c.get_embeddings([key(6)]) == [None]  # cut off at its timeout, by the clock
            assert entered.is_set() and clock() - before == setup_s
        finally:
            gate.set()
        assert wait_until(lambda: not c._transport._meta.is_busy(), 10)  # the setup finished
        clock.advance(RETRY_AFTER)
        assert c.insert_batch([key(6)], [torch.ones(2)]) == [True]
        assert c.is_connected()


def test_tensors_reused_after_an_insert_timed_out_are_never_stored(
    master: FakeMooncakeMaster, clock: FakeClock, hangs: Hangs, holder: FakeMooncakeStore
) -> None:
    # the first staging flush outlives the timeout: insert_batch returns and the caller
    # reuses its tensors; the worker must not encode the rest of the batch from them
    config = MooncakeConfig(
        master_server_address=master.address,
        global_segment_size=0,
        local_buffer_size=4 * MiB,
        timeout=TIMEOUT,
        retry_after=RETRY_AFTER,
    )
    with MooncakeCache(config, keyring=None, store_class=store_class(hangs), clock=clock) as c:
        keys = [key(7 + i) for i in range(6)]
        tensors = [torch.full((MiB // 4,), float(i)) for i in range(6)]  # 1 MiB each
        originals = [t.clone() for t in tensors]
        hangs.hang("batch_upsert_from")
        assert c.insert_batch(keys, tensors) == [False] * 6
        assert hangs.entered["batch_upsert_from"].is_set()
        for t in tensors:
            t.fill_(-1.0)  # the caller's buffers, reused
        hangs.release()  # the first flush lands late
        assert wait_until(lambda: c.health().busy_lanes == 0, 10)
        assert wait_until(lambda: master.keys() != [], 10)
        clock.advance(RETRY_AFTER)  # the breaker the timeout opened lets calls through again
        assert c.batch_is_exist(keys[:1]) == [True]
        served = c.get_embeddings(keys)
        assert served[0] is not None, "the late first flush landed"
        for got, want in zip(served, originals, strict=True):
            assert got is None or torch.equal(got, want)  # never the reused buffers' -1s


def a_paged_cache(master: FakeMooncakeMaster, clock: FakeClock, hangs: Hangs) -> MooncakeCache:
    """A cache in trusted-network mode: entries go to and from registered memory directly."""
    config = MooncakeConfig(
        master_server_address=master.address,
        global_segment_size=0,
        local_buffer_size=8 * MiB,
        timeout=TIMEOUT,
        retry_after=RETRY_AFTER,
        trusted_network=True,
    )
    return MooncakeCache(config, keyring=None, store_class=store_class(hangs), clock=clock)


def test_a_hung_paged_read_and_write_are_misses_at_their_give_up_time(
    master: FakeMooncakeMaster, clock: FakeClock, hangs: Hangs, holder: FakeMooncakeStore
) -> None:
    src = torch.randn(64, 64).to(torch.bfloat16)
    with a_paged_cache(master, clock, hangs) as c:
        c.register_memory(src)
        assert c.insert_from([key(20)], [[src[:8]]]) == [True]
        hangs.hang("batch_get_into")
        dst = torch.zeros(8, 64, dtype=torch.bfloat16)
        before = clock()
        assert c.read_into([key(20)], [dst]) == [False]
        assert clock() - before == HUNG_FOR and not dst.any(), "cut off by the clock, nothing written"
        hangs.release()
        assert wait_until(lambda: c.health().busy_lanes == 0, 10)
        clock.advance(RETRY_AFTER)
        hangs.hang("batch_put_from_multi_buffers")
        before = clock()
        assert c.insert_from([key(21)], [[src[8:16]]]) == [False]
        assert clock() - before == HUNG_FOR
        assert c.stats().errors == 2
        hangs.release()
        assert wait_until(lambda: c.health().busy_lanes == 0, 10)
        clock.advance(RETRY_AFTER)
        assert c.read_into([key(20)], [dst]) == [True] and torch.equal(dst, src[:8])


def test_an_add_to_a_master_that_hangs_fails_at_its_give_up_time(
    master: FakeMooncakeMaster, clock: FakeClock, hangs: Hangs, holder: FakeMooncakeStore
) -> None:
    from mmkey.cache.mooncake import Added

    src = torch.randn(16, 64).to(torch.bfloat16)
    with a_paged_cache(master, clock, hangs) as c:
        c.register_memory(src)
        hangs.hang("batch_put_session_start")
        before = clock()
        assert c.add_from([key(22)], [src[:8]]) == [Added.FAILED]
        assert clock() - before == HUNG_FOR
        hangs.release()
        assert wait_until(lambda: c.health().busy_lanes == 0, 10)
        clock.advance(RETRY_AFTER)
        # the late start is settled on the lane (no reservation is left behind): added now or before
        assert c.add_from([key(22)], [src[:8]]) in ([Added.STORED], [Added.HELD])
        assert master.reserved() == []
        [got] = c.get_embeddings([key(22)])
        assert got is not None and torch.equal(got, src[:8])


def test_a_claim_waits_poll_cut_off_by_the_waits_own_bound_leaves_the_breaker_closed(
    master: FakeMooncakeMaster, clock: FakeClock, hangs: Hangs, holder: FakeMooncakeStore
) -> None:
    """A lookup slower than the claim wait (a live master on a busy host) ends the wait, and
    counts an error, but is not taken for a master fault: the next call goes to the store."""
    config = settings(master, claim_wait=0.3)
    with MooncakeCache(config, keyring=None, store_class=store_class(hangs), clock=clock) as c:
        put(holder, key(30), torch.ones(4))
        assert c.batch_is_exist([key(30)]) == [True]  # set up, the breaker closed
        hangs.hang("batch_is_exist", seconds=1.0)  # past the wait's 0.3 s, within the 2 s timeout
        assert c.wait_for_embeddings([key(30)]) == [None]
        stats = c.stats()
        assert (stats.errors, stats.waits_timed_out) == (1, 1)
        assert c.health().breaker_open is False
        hangs.release()
        assert wait_until(lambda: c.health().busy_lanes == 0, 10)
        [got] = c.get_embeddings([key(30)])
        assert got is not None and torch.equal(got, torch.ones(4)), "the store was asked, not skipped"
        assert c.stats().skipped == 0


def test_a_hung_write_holds_writes_and_claims_off_until_a_trial_lands_by_the_clock(
    master: FakeMooncakeMaster, clock: FakeClock, hangs: Hangs, holder: FakeMooncakeStore
) -> None:
    """The master places a write, so which holder hangs is unknown: after a write timed out,
    writes are skipped without a store call and claims are not taken (the entry would not
    land), until `retry_after` lets one trial through, by the clock."""
    config = settings(master, claim_wait=0.3)
    with MooncakeCache(config, keyring=None, store_class=store_class(hangs), clock=clock) as c:
        hangs.hang("batch_upsert_from")  # held until the end: its lane stays stuck
        assert c.insert_batch([key(40)], [torch.ones(4)]) == [False]
        assert c.health().writes_held and not c.health().breaker_open
        calls, skipped = master.calls["batch_upsert_from"], c.stats().skipped
        assert c.insert_batch([key(41)], [torch.ones(4)]) == [False]
        assert master.calls["batch_upsert_from"] == calls, "held off: the store was not asked"
        assert c.stats().skipped == skipped + 1
        assert c.claim([key(42)]) == [Claim.UNCLAIMED]
        assert master.reserved() == [], "no lease taken"
        clock.advance(RETRY_AFTER - 1.0)
        assert c.insert_batch([key(41)], [torch.ones(4)]) == [False]
        assert master.calls["batch_upsert_from"] == calls
        clock.advance(1.0)
        assert c.insert_batch([key(41)], [torch.ones(4)]) == [True], "the trial, on another lane"
        assert not c.health().writes_held
        assert c.claim([key(42)]) == [Claim.WON]
        c.release([key(42)])


def test_trial_writes_to_a_holder_that_stays_hung_back_off_by_the_clock(
    master: FakeMooncakeMaster, clock: FakeClock, hangs: Hangs, holder: FakeMooncakeStore
) -> None:
    """A trial write to a hung holder keeps a client thread busy until the transfer's deadline,
    so each trial that fails doubles the wait before the next (`RETRY_BACKOFF`)."""
    with MooncakeCache(settings(master), keyring=None, store_class=store_class(hangs), clock=clock) as c:
        hangs.hang("batch_upsert_from")
        assert c.insert_batch([key(47)], [torch.ones(4)]) == [False]
        for wait in (RETRY_AFTER, 2 * RETRY_AFTER):  # two trials fail, each on a lane of its own
            hangs.hang("batch_upsert_from")  # the holder still hangs
            clock.advance(wait - 0.5)
            assert c.insert_batch([key(48)], [torch.ones(4)]) == [False]
            assert not hangs.entered["batch_upsert_from"].is_set(), f"a trial before its wait of {wait} s"
            clock.advance(0.5)
            assert c.insert_batch([key(48)], [torch.ones(4)]) == [False]
            assert hangs.entered["batch_upsert_from"].is_set(), "the trial"
        assert c._transport.write_breaker.wait == 4 * RETRY_AFTER
        assert c.health().writes_held
        # the probes of a quarantined holder back off alike (tests/cache/mooncake/test_quarantine.py)
        assert c._transport.quarantine._longest == RETRY_BACKOFF * RETRY_AFTER


def test_a_timed_out_write_that_lands_late_lifts_the_hold_at_once(
    master: FakeMooncakeMaster, clock: FakeClock, hangs: Hangs, holder: FakeMooncakeStore
) -> None:
    """On a busy host a healthy holder's write can miss its deadline; its late landing proves
    the holder answers, so writes go on without waiting for `retry_after`."""
    with MooncakeCache(settings(master), keyring=None, store_class=store_class(hangs), clock=clock) as c:
        hangs.hang("batch_upsert_from")
        assert c.insert_batch([key(43)], [torch.ones(4)]) == [False]
        assert c.health().writes_held
        hangs.release()  # the write lands, late
        assert wait_until(lambda: not c.health().writes_held, 10), c.health()
        assert c.insert_batch([key(44)], [torch.ones(4)]) == [True]
        got = c.get_embeddings([key(43), key(44)])
        assert all(g is not None and torch.equal(g, torch.ones(4)) for g in got)


def test_a_write_cut_off_by_its_callers_short_bound_does_not_hold_writes_off(
    master: FakeMooncakeMaster, clock: FakeClock, hangs: Hangs, holder: FakeMooncakeStore
) -> None:
    """A write given less than half the timeout (what is left of a call that waited for
    reserved keys) that runs out says nothing about the holder, as with a lookup."""
    with MooncakeCache(settings(master), keyring=None, store_class=store_class(hangs), clock=clock) as c:
        hangs.hang("batch_upsert_from", seconds=TIMEOUT / 3)  # past its bound, within the timeout
        text = key(45).to_key()
        assert c._writer.write([text], [torch.ones(4)], clock() + TIMEOUT / 4) == {}
        assert not c.health().writes_held
        hangs.release()
        assert wait_until(lambda: c.health().busy_lanes == 0, 10)
        assert c.insert_batch([key(46)], [torch.ones(4)]) == [True]
