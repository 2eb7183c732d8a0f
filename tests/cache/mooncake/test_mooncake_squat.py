"""A squatted key heals and shows: put sessions that another client starts on keys the store
does not hold, and never writes, do not block honest adds for longer than the wait for a
write in progress; the writer then upserts its own entry over them, counts the squat apart
from honest skips and warns once. Against a real local master, and with an injected clock
on the fake store for the bounded wait."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig, mm_hash
from mmkey.cache.mooncake import Added
from mmkey.cache.mooncake._reserved import RESERVED_WAIT_S, Reservations
from mmkey.cache.mooncake._writes import Writer
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore
from mmkey.testing.mooncake_master import MasterProcess
from tests._support import ROOMY_TIMEOUT, MiB, local_config, raw_client, wait_until

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

NAMESPACE = "squat-model"
DIM = 64
VICTIMS = 20
RENEW_S = 0.2
"""How often the squatter revokes and restarts its sessions (well inside the master's 30 s
discard timeout, so that the master never discards them)."""


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey(NAMESPACE, Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


def embedding(seed: int, rows: int = 8) -> torch.Tensor:
    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def squat_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "mmkey.cache.mooncake" and r.levelno == logging.WARNING and "reserved" in r.getMessage()
    ]


class Squatter:
    """A raw client that starts put sessions on victim keys, never writes them, and renews
    them (revoke, restart) every `RENEW_S` until stopped."""

    def __init__(self, client: MooncakeDistributedStore, texts: list[str]) -> None:
        self._client = client
        self._texts = texts
        self._stop = threading.Event()
        self.renewals = 0
        self._thread = threading.Thread(target=self._renew, daemon=True)

    def __enter__(self) -> Squatter:
        sizes = [4096] * len(self._texts)
        assert self._client.batch_put_session_start(self._texts, sizes) == [0] * len(self._texts)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._client.batch_put_session_revoke(self._texts)

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            self._client.batch_put_session_revoke(self._texts)
            self._client.batch_put_session_start(self._texts, [4096] * len(self._texts))
            self.renewals += 1


@pytest.mark.mooncake
@pytest.mark.parametrize("trusted", [False, True], ids=["staged", "from-registered-memory"])
def test_a_renewing_squatter_is_written_over_counted_and_warned_once(
    mooncake_master_session: MasterProcess, caplog: pytest.LogCaptureFixture, trusted: bool
) -> None:
    victims = [key(1000 * trusted + i) for i in range(VICTIMS)]
    texts = [k.to_key() for k in victims]
    memory = torch.cat([embedding(i) for i in range(VICTIMS)])
    payloads = [memory[8 * i : 8 * (i + 1)] for i in range(VICTIMS)]
    caplog.set_level(logging.WARNING, logger="mmkey.cache.mooncake")
    config = local_config(mooncake_master_session, timeout=ROOMY_TIMEOUT, trusted_network=trusted)
    with (
        MooncakeCache(config) as cache,
        raw_client(local_config(mooncake_master_session, global_segment_size=0)) as raw,
        Squatter(raw, texts) as squatter,
    ):
        cache.register_memory(memory)
        outcomes: list[Added] = []

        def stored() -> bool:
            outcomes[:] = cache.add_from(victims, payloads)
            return outcomes == [Added.STORED] * VICTIMS

        assert wait_until(stored, 30, poll=RENEW_S), outcomes  # each written over the squat
        renewed = squatter.renewals
        # the squatter keeps renewing: it cannot take them back
        assert wait_until(lambda: squatter.renewals > renewed, 30 * RENEW_S)
        assert cache.add_from(victims, payloads) == [Added.HELD] * VICTIMS
        got = cache.get_embeddings(victims)
        assert all(g is not None and torch.equal(g, p) for g, p in zip(got, payloads, strict=True))
        stats = cache.stats()
        assert stats.squatted == VICTIMS
        assert stats.skipped == 0  # a squat is not an honest skip
        assert stats.inserts == VICTIMS
    [warning] = squat_warnings(caplog)
    assert f"{VICTIMS} key(s) of namespace '{NAMESPACE}'" in warning


# -- the bounded wait, with an injected clock on the fake store -----------------------------


class Clock:
    """A clock the writer reads and sleeps on: a sleep moves it on at once, and may run a
    callback first (another client's write landing during the wait)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.naps: list[float] = []
        self.during_nap: list[object] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds
        if self.during_nap:
            callback = self.during_nap.pop(0)
            if callable(callback):
                callback()


@pytest.fixture
def master() -> Iterator[FakeMooncakeMaster]:
    with FakeMooncakeMaster() as m:
        yield m


def fake_client(master: FakeMooncakeMaster, segment: int = 0) -> FakeMooncakeStore:
    store = FakeMooncakeStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 * MiB, "tcp", "", master.address) == 0
    return store


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache(master: FakeMooncakeMaster, clock: Clock) -> Iterator[MooncakeCache]:
    config = MooncakeConfig(
        master_server_address=master.address,
        global_segment_size=64 * MiB,
        local_buffer_size=8 * MiB,
        timeout=5.0,  # ample: the waits are on the injected clock
        retry_after=30.0,
    )
    with MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore) as c:
        c._writer = Writer(c._parts, clock=clock, sleep=clock.sleep)
        yield c


def test_a_reserved_absent_key_is_written_over_once_its_wait_is_over(
    master: FakeMooncakeMaster, cache: MooncakeCache, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    squatter = fake_client(master)
    text = key(1).to_key()
    assert squatter.batch_put_session_start([text], [4096]) == [0]
    fresh = embedding(1)
    caplog.set_level(logging.WARNING, logger="mmkey.cache.mooncake")
    assert cache.add_from([key(1)], [fresh]) == [Added.STORED]
    assert sum(clock.naps) == pytest.approx(RESERVED_WAIT_S)  # the whole wait, and no longer
    assert max(clock.naps) <= RESERVED_WAIT_S / 5  # looked at again within it
    [got] = cache.get_embeddings([key(1)])
    assert got is not None and torch.equal(got, fresh)
    assert squatter.batch_put_session_revoke([text]) != [0]  # the squat is gone for good
    assert (cache.stats().squatted, cache.stats().skipped) == (1, 0)
    assert len(squat_warnings(caplog)) == 1
    assert len(cache._writer._reserved) == 0  # forgotten once written


def test_a_write_in_progress_that_lands_within_the_wait_is_held_not_written_over(
    master: FakeMooncakeMaster, cache: MooncakeCache, clock: Clock
) -> None:
    other = fake_client(master, segment=16 * MiB)
    text = key(2).to_key()
    assert other.batch_put_session_start([text], [4096]) == [0]
    theirs = b"x" * 4096
    # the third look finds their write landed (here: the session revoked, a plain put)
    clock.during_nap = [None, None, lambda: (other.batch_put_session_revoke([text]), other.put(text, theirs))]
    assert cache.add_from([key(2)], [embedding(2)]) == [Added.HELD]
    assert sum(clock.naps) < RESERVED_WAIT_S  # stopped looking once it landed
    assert other.get(text) == theirs  # not written over
    assert cache.stats().squatted == 0


def test_a_wait_longer_than_half_the_call_leaves_the_key_reserved_for_a_later_add(
    master: FakeMooncakeMaster, cache: MooncakeCache, clock: Clock
) -> None:
    cache._writer = Writer(cache._parts, clock=clock, sleep=clock.sleep, reserved_wait=10.0)
    squatter = fake_client(master)
    text = key(3).to_key()
    assert squatter.batch_put_session_start([text], [4096]) == [0]
    assert cache.add_from([key(3)], [embedding(3)]) == [Added.RESERVED]  # 10 s do not fit in 5 s
    assert clock.naps == []
    clock.now += 6.0
    assert cache.add_from([key(3)], [embedding(3)]) == [
        Added.RESERVED
    ]  # the wait counts from the first sight
    clock.now += 4.0
    assert cache.add_from([key(3)], [embedding(3)]) == [Added.STORED]
    assert clock.naps == []  # the wait was over: no look again, the upsert at once
    assert cache.stats().squatted == 1


def test_a_held_key_is_held_at_once_without_a_wait(
    master: FakeMooncakeMaster, cache: MooncakeCache, clock: Clock
) -> None:
    other = fake_client(master, segment=16 * MiB)
    assert other.put(key(4).to_key(), b"held") == 0
    assert cache.add_from([key(4)], [embedding(4)]) == [Added.HELD]
    assert clock.naps == []
    assert cache.stats().squatted == 0


def test_the_memory_of_reserved_keys_is_bounded(clock: Clock) -> None:
    reservations = Reservations(1.0, clock, limit=3)
    assert reservations.due(["a", "b"]) == clock.now + 1.0
    clock.now += 0.5
    assert reservations.due(["a", "c", "d"]) == clock.now + 1.0  # c and d start now
    assert len(reservations) == 3  # a is the oldest: forgotten
    reservations.forget(["c", "d", "x"])
    assert len(reservations) == 1
