"""The transport's documented bounds and its set-up and probe failures, on the fake store: three
staging buffers of at most 256 MiB, trials backing off to 16 times ``retry_after``, a set-up
that fails counted as a failure, and a probe that raises leaving its holder quarantined."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig, mm_hash
from mmkey.cache.mooncake._transport import StoreTransport
from mmkey.entry.codec import encode_entry
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore
from tests._clock import FakeClock
from tests._support import wait_until

MiB = 1 << 20


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("transport-pins", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


@pytest.fixture
def master() -> Iterator[FakeMooncakeMaster]:
    with FakeMooncakeMaster() as m:
        yield m


def config(master: FakeMooncakeMaster, **overrides: Any) -> MooncakeConfig:
    fields: dict[str, Any] = {
        "master_server_address": master.address,
        "global_segment_size": 16 * MiB,
        "local_buffer_size": 1 * MiB,
        "timeout": 2.0,
        "retry_after": 30.0,
    }
    return MooncakeConfig(**{**fields, **overrides})


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
