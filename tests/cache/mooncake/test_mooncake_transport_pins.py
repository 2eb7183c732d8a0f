"""The transport's documented bounds and its set-up and probe failures, on the fake store: three
staging buffers of at most 256 MiB, trials backing off to 16 times ``retry_after``, a set-up
that fails counted as a failure, and a probe that raises leaving its holder quarantined; which
memory a region holds or overlaps; when a call asks the master before the store (only after a
failure); when a store is set up, closed or left abandoned; and which failures are master faults."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig, mm_hash
from mmkey._deadline import Failed, Why
from mmkey.cache.health import CacheHealth
from mmkey.cache.mooncake._transport import _ABANDONED, Region, StoreTransport, close_abandoned
from mmkey.entry.codec import encode_entry
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore
from tests._clock import FakeClock
from tests._support import wait_until
from tests.cache.mooncake.pins_support import fake_config

MiB = 1 << 20


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("transport-pins", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


@pytest.fixture
def master() -> Iterator[FakeMooncakeMaster]:
    with FakeMooncakeMaster() as m:
        yield m


def config(master: FakeMooncakeMaster, **overrides: Any) -> MooncakeConfig:
    return fake_config(master, **overrides)


class NeverSetUp:
    """A store class the transport never instantiates here (no connect)."""


@pytest.mark.parametrize(("buffer", "each"), [(4 * MiB, 4 * MiB), (1 << 30, 256 * MiB)])
def test_staging_is_three_buffers_of_the_transfer_buffer_size_at_most_256_mib(buffer: int, each: int) -> None:
    settings = MooncakeConfig(master_server_address="127.0.0.1:9", local_buffer_size=buffer)
    transport = StoreTransport(settings, NeverSetUp, lambda: None, lambda: None)  # type: ignore[arg-type]
    try:
        assert [lane.staging.nbytes for lane in transport.lanes] == [each] * 3
    finally:
        transport.close()


def test_failed_trial_writes_wait_twice_as_long_each_up_to_16_times_retry_after() -> None:
    clock = FakeClock()
    settings = MooncakeConfig(master_server_address="127.0.0.1:9", retry_after=1.0)
    transport = StoreTransport(settings, NeverSetUp, lambda: None, lambda: None, clock)  # type: ignore[arg-type]
    try:
        breaker = transport.write_breaker
        breaker.failure()
        waits = []
        for _ in range(7):
            clock.advance(breaker.wait)
            assert breaker.allow()  # the trial
            breaker.failure()
            waits.append(breaker.wait)
        assert waits == [2.0, 4.0, 8.0, 16.0, 16.0, 16.0, 16.0]
    finally:
        transport.close()


def test_a_store_whose_set_up_fails_is_a_counted_failure(master: FakeMooncakeMaster) -> None:
    class Refuses(FakeMooncakeStore):
        def setup(self, *args: Any, **kwargs: Any) -> int:
            return -1

    with MooncakeCache(config(master), keyring=None, store_class=Refuses) as cache:
        assert not cache.is_connected()
        assert cache.health().breaker_open
        assert cache.stats().errors == 1
        assert cache.get_embeddings([key(1)]) == [None]


def test_staging_that_cannot_be_registered_fails_the_set_up_until_it_can(master: FakeMooncakeMaster) -> None:
    master.fail_next("register_buffer", code=-1)  # the first lane's staging buffer
    with MooncakeCache(
        config(master, retry_after=0.05), keyring=None, store_class=FakeMooncakeStore
    ) as cache:
        assert not cache.is_connected()
        assert cache.stats().errors == 1
        assert wait_until(lambda: cache.insert_batch([key(2)], [torch.ones(4)]) == [True], 10)
        got = cache.get_embeddings([key(2)])[0]
        assert got is not None and torch.equal(got, torch.ones(4))


def test_memory_whose_registration_failed_is_sent_through_staging(master: FakeMooncakeMaster) -> None:
    pool = torch.arange(64, dtype=torch.float32)
    with MooncakeCache(
        config(master, trusted_network=True), keyring=None, store_class=FakeMooncakeStore
    ) as cache:
        master.fail_next("register_buffer", code=-1, times=2)  # at register_memory, then at the put
        cache.register_memory(pool)
        assert cache.insert_from([key(3)], [pool[:8]]) == [True]
        assert master.calls["batch_put_from_multi_buffers"] == 0  # staged: no put from the pool
        got = cache.get_embeddings([key(3)])[0]
        assert got is not None and torch.equal(got, pool[:8])


def test_a_probe_that_raises_leaves_its_holder_quarantined(master: FakeMooncakeMaster) -> None:
    holder = FakeMooncakeStore()
    assert holder.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", master.address) == 0
    endpoint = holder.get_hostname()
    text = key(4).to_key()
    try:
        assert holder.upsert(text, encode_entry(text, torch.ones(4))) == 0
        settings = config(master, global_segment_size=0, retry_after=0.05)
        with MooncakeCache(settings, keyring=None, store_class=FakeMooncakeStore) as cache:
            master.make_unreachable(endpoint)
            assert cache.get_embeddings([key(4)]) == [None]
            assert wait_until(lambda: cache.health().quarantined == (endpoint,), 10)
            master.make_unreachable(endpoint, False)
            master.fail_next("register_buffer", code=-1, times=1000)  # each probe's read raises

            def probed() -> bool:  # a read while quarantined is a miss; one of them sends the probe
                return cache.get_embeddings([key(4)]) == [None] and master.calls["get_size"] >= 1

            assert wait_until(probed, 10)
            assert wait_until(lambda: not cache._transport._prober.is_busy(), 10)
            assert cache.health().quarantined == (endpoint,)
    finally:
        holder.close()


@pytest.mark.parametrize("code", [-900, -901], ids=["rpc-fail", "rpc-timeout"])
def test_either_code_of_a_master_that_did_not_answer_opens_the_breaker(
    master: FakeMooncakeMaster, code: int
) -> None:
    with MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore) as cache:
        assert cache.insert_batch([key(5)], [torch.ones(4)]) == [True]
        master.fail_next("batch_is_exist", code=code)
        assert cache.batch_is_exist([key(5)]) == [False]
        assert cache.health().breaker_open
        assert cache.stats().errors == 1


def test_close_unregisters_every_staging_buffer_before_the_store_closes(master: FakeMooncakeMaster) -> None:
    cache = MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore)
    assert cache.insert_batch([key(6)], [torch.ones(4)]) == [True]
    assert master.calls["unregister_buffer"] == 0
    cache.close()
    assert master.calls["unregister_buffer"] == 3  # one per transfer lane


def test_a_region_holds_exactly_the_spans_inside_its_bytes() -> None:
    region = Region(torch.zeros(0), start=100, nbytes=50)
    assert region.holds(100, 50) and region.holds(149, 1) and region.holds(120, 0)
    assert not region.holds(99, 1) and not region.holds(99, 2)
    assert not region.holds(150, 1) and not region.holds(140, 11)


def test_adjacent_memory_registers_and_overlapping_memory_is_refused() -> None:
    settings = MooncakeConfig(master_server_address="127.0.0.1:9", trusted_network=True)
    transport = StoreTransport(settings, NeverSetUp, lambda: None, lambda: None)  # type: ignore[arg-type]
    try:
        pool = torch.zeros(32)
        low = transport.register_memory(pool[8:16])
        high = transport.register_memory(pool[16:24])  # starts where the first ends
        below = transport.register_memory(pool[:8])  # ends where the first starts
        assert [low.start, high.start, below.start] == [pool[i:].data_ptr() for i in (8, 16, 0)]
        for overlapping in (pool[4:12], pool[12:20], pool[10:12], pool[:32]):
            with pytest.raises(ValueError, match="overlaps"):
                transport.register_memory(overlapping)
        assert transport.region_of(pool[16:].data_ptr(), 32) is high
        assert transport.region_of(pool[15:].data_ptr(), 8) is None  # spans two regions
    finally:
        transport.close()


def test_a_call_after_a_set_up_or_a_success_goes_straight_to_the_store(master: FakeMooncakeMaster) -> None:
    """Only a failed call makes the next one ask the master first (a silent one: no store call)."""
    with MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore) as cache:
        master.kill()  # the liveness probe goes unanswered; store calls fail with RPC_FAIL
        assert cache.batch_is_exist([key(7)]) == [False]
        assert master.calls["batch_is_exist"] == 1, "the first call after the set-up asks the store"
        assert cache.health().breaker_open and cache.stats().errors == 1
        master.restart()
    with MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore) as cache:
        assert cache.insert_batch([key(8)], [torch.ones(4)]) == [True]
        master.kill()
        before = master.calls["batch_is_exist"]
        assert cache.batch_is_exist([key(8)]) == [False]
        assert master.calls["batch_is_exist"] == before + 1, "a call after a success asks the store"
        master.restart()


def test_an_abandoned_store_is_closed_only_once_its_master_answers(master: FakeMooncakeMaster) -> None:
    """`close_abandoned` leaves a store whose lanes stopped alone while its master is silent."""
    cache = MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore)
    assert cache.insert_batch([key(9)], [torch.ones(4)]) == [True]
    transport = cache._transport
    master.kill()  # pings go unanswered: close abandons the store
    try:
        cache.close()
        assert transport.join(10)
        assert transport in [t for t, _ in _ABANDONED]
        close_abandoned(0.5)
        assert transport in [t for t, _ in _ABANDONED], "closed while its master was silent"
    finally:
        master.restart()
    assert close_abandoned() >= 1
    assert transport not in [t for t, _ in _ABANDONED]


def test_after_a_failed_call_the_trial_asks_a_silent_master_before_the_store(
    master: FakeMooncakeMaster,
) -> None:
    """A call after one that failed goes to the store only if the master answers its probe."""
    clock = FakeClock()
    settings = config(master, retry_after=1.0)
    with MooncakeCache(settings, keyring=None, store_class=FakeMooncakeStore, clock=clock) as cache:
        master.kill()
        assert cache.batch_is_exist([key(10)]) == [False]
        assert master.calls["batch_is_exist"] == 1 and cache.health().breaker_open
        clock.advance(1.5)  # past retry_after: the next call is the trial
        assert cache.batch_is_exist([key(10)]) == [False]
        assert master.calls["batch_is_exist"] == 1, "the trial went to the store of a silent master"
        assert cache.stats().errors == 2
        master.restart()


def test_a_store_closed_with_less_than_a_second_of_timeout_is_closed_not_abandoned(
    master: FakeMooncakeMaster,
) -> None:
    """`close` closes the store whenever any of its timeout is left and the master answers."""
    cache = MooncakeCache(config(master, timeout=0.5), keyring=None, store_class=FakeMooncakeStore)
    assert cache.insert_batch([key(11)], [torch.ones(4)]) == [True]
    transport = cache._transport
    cache.close()
    assert master.calls["unregister_buffer"] == 3
    assert transport not in [t for t, _ in _ABANDONED]


def test_no_set_up_is_tried_while_the_master_is_silent(master: FakeMooncakeMaster) -> None:
    """The store is set up only right after the master answered its probe."""
    tried: list[object] = []

    class Counted(FakeMooncakeStore):
        def setup(self, *args: Any, **kwargs: Any) -> int:
            tried.append(args)
            return super().setup(*args, **kwargs)

    master.kill()
    try:
        with MooncakeCache(config(master), keyring=None, store_class=Counted) as cache:
            assert not cache.is_connected() and cache.health().breaker_open
            assert tried == [] and cache.stats().errors == 1
    finally:
        master.restart()


def test_a_set_up_given_less_than_a_second_still_connects(master: FakeMooncakeMaster) -> None:
    """Any time left before the set-up's give-up time is enough to try it."""
    clock = FakeClock()  # the set-up's time is not used up by a busy host
    settings = config(master, setup_timeout=0.5)
    with MooncakeCache(settings, keyring=None, store_class=FakeMooncakeStore, clock=clock) as cache:
        assert cache.is_connected()
        assert master.calls["setup"] == 1


@pytest.mark.parametrize(("share", "master_fault"), [(0.4, False), (0.6, True)])
def test_a_lookup_cut_off_by_a_bound_under_half_the_timeout_is_no_master_fault(
    master: FakeMooncakeMaster, share: float, master_fault: bool
) -> None:
    """A metadata call given less than half the timeout that runs out leaves the breaker closed."""
    clock = FakeClock()
    settings = config(master, timeout=2.0)
    with MooncakeCache(settings, keyring=None, store_class=FakeMooncakeStore, clock=clock) as cache:
        assert cache.batch_is_exist([key(12)]) == [False]  # set up, the breaker closed
        release = threading.Event()

        def hang(store: object) -> None:
            clock.advance(2.0)  # past the call's bound (and the timeout)
            release.wait(10)

        transport = cache._transport
        try:
            outcome = transport.meta(hang, clock() + share * 2.0)
        finally:
            release.set()
        assert isinstance(outcome, Failed) and outcome.why is Why.TIMED_OUT
        assert cache.health().breaker_open is master_fault
        assert cache.stats().errors == 1
        assert wait_until(lambda: not transport._meta.is_busy(), 10)


def test_after_a_timed_out_transfer_the_next_call_asks_a_silent_master_first(
    master: FakeMooncakeMaster,
) -> None:
    """A transfer that timed out makes the master suspect: the next call probes it before the store."""
    with MooncakeCache(config(master, timeout=1.0), keyring=None, store_class=FakeMooncakeStore) as cache:
        assert cache.insert_batch([key(13)], [torch.ones(4)]) == [True]
        master.delay("batch_get_into", 3.0)
        assert cache.get_embeddings([key(13)]) == [None]  # cut off by the timeout
        master.delay("batch_get_into", 0)
        assert cache.stats().errors == 1 and not cache.health().breaker_open
        assert wait_until(lambda: cache.health() == CacheHealth(), 10)  # the late transfer done
        master.kill()
        before = master.calls["batch_is_exist"]
        assert cache.batch_is_exist([key(13)]) == [False]
        assert master.calls["batch_is_exist"] == before, "asked the store of a silent master"
        assert cache.health().breaker_open
        master.restart()


def test_a_call_on_a_closed_transport_is_refused_and_counted_nowhere() -> None:
    """After `close`, a call (one racing the cache's close) is refused: no error, no skip, no breaker."""
    counted: list[str] = []
    settings = MooncakeConfig(master_server_address="127.0.0.1:9")
    transport = StoreTransport(
        settings,
        NeverSetUp,  # type: ignore[arg-type]
        lambda: counted.append("error"),
        lambda: counted.append("skip"),
        FakeClock(),
    )
    transport.close()
    outcome = transport.meta(lambda store: True, transport.clock() + 1.0)
    assert isinstance(outcome, Failed) and outcome.why is Why.NOT_STARTED
    assert counted == [] and not transport.breaker.is_open()
    transport.close()  # a second close does nothing
    assert counted == []


def test_a_lookup_that_raises_a_non_store_error_is_counted_but_no_master_fault(
    master: FakeMooncakeMaster,
) -> None:
    """`meta`: an exception of the function that is not a store error leaves the breaker closed."""
    with MooncakeCache(config(master), keyring=None, store_class=FakeMooncakeStore) as cache:
        assert cache.batch_is_exist([key(14)]) == [False]  # set up, the breaker closed

        def broken(store: object) -> None:
            raise ValueError("not the store's fault")

        transport = cache._transport
        outcome = transport.meta(broken, transport.clock() + 2.0)
        assert isinstance(outcome, Failed) and outcome.why is Why.RAISED
        assert isinstance(outcome.error, ValueError)
        assert not cache.health().breaker_open and cache.stats().errors == 1
        assert cache.batch_is_exist([key(14)]) == [False] and cache.stats().skipped == 0
