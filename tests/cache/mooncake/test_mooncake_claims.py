"""Single-flight claims of `MooncakeCache` (``claim``, ``release``, ``wait_for_embeddings``),
against the real binding and `mmkey.testing.fake_mooncake` alike: of two clients one wins a
key, callers of one cache coalesce, a release frees the key, a won key already written needs no
encode, a squatter's lease costs a waiter the bound and no more, and waits are timed by the
cache's injected clock in the logic tests."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, mm_hash
from mmkey._deadline import Done
from mmkey.cache.mooncake import MooncakeConfig
from mmkey.cache.mooncake._claims import LEASE_SUFFIX, POLL_MAX_S, PROBE_EVERY_S, Claims, lease_key
from mmkey.cache.mooncake._transport import INVALID_PARAMS
from mmkey.cache.protocol import CacheStats, Claim, ClaimingCache
from mmkey.errors import InvalidKey
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore
from mmkey.testing.mooncake_master import MasterProcess, running_master
from mmkey.testing.pytest_plugin import _require_master
from tests._clock import FakeClock
from tests._support import MiB, wait_until

WAIT = {"real": 2.0, "fake": 0.3}
"""The claim wait of each store: on a real master a lookup on a crowded host can take longer
than the fake's bound, and a wait that runs out before it answers finds nothing."""


@pytest.fixture(scope="module", params=[pytest.param("real", marks=pytest.mark.mooncake), "fake"])
def pool(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Caches on a real master or a fake one, kept for the module (a real cache's close stops
    the process for a second or two): the n-th cache asked for with given settings is reused."""
    made: dict[tuple[object, ...], MooncakeCache] = {}
    if request.param == "real":
        master: MasterProcess | FakeMooncakeMaster = request.getfixturevalue("mooncake_master_session")
        store_class = None
    else:
        master = FakeMooncakeMaster().__enter__()
        store_class = FakeMooncakeStore
    yield {"master": master, "store_class": store_class, "made": made, "wait": WAIT[request.param]}
    for c in made.values():
        c.close()
    if isinstance(master, FakeMooncakeMaster):
        master.__exit__(None, None, None)


@pytest.fixture
def wait(pool: dict[str, Any]) -> float:
    """The claim wait of the caches `make` makes."""
    bound: float = pool["wait"]
    return bound


@pytest.fixture
def make(pool: dict[str, Any]) -> Any:
    """Makes caches (each a client of its own): the first, second... of a test with given
    settings are the module's first, second... with them (their stats carry over: compare
    deltas)."""
    used: Counter[tuple[object, ...]] = Counter()

    def cache(**overrides: Any) -> MooncakeCache:
        fields: dict[str, Any] = {
            "master_server_address": pool["master"].address,
            "global_segment_size": 16 * MiB,
            "local_buffer_size": 4 * MiB,
            "timeout": 5.0,
            "retry_after": 0.2,
            "claim_wait": pool["wait"],
        }
        fields.update(overrides)
        settings = tuple(sorted(overrides.items()))
        slot = (*settings, used[settings])
        used[settings] += 1
        if slot not in pool["made"]:
            config = MooncakeConfig(**fields)
            pool["made"][slot] = MooncakeCache(config, keyring=None, store_class=pool["store_class"])
        made: MooncakeCache = pool["made"][slot]
        return made

    return cache


def delta(cache: ClaimingCache, before: CacheStats) -> dict[str, int]:
    """The single-flight counters of `cache` since `before`."""
    now = cache.stats()
    names = ("claims_won", "waits_served", "waits_timed_out", "coalesced")
    return {name: getattr(now, name) - getattr(before, name) for name in names}


def fresh(n: int) -> list[EmbeddingKey]:
    """Keys no other test (or earlier run on the session's master) uses."""
    base = uuid.uuid4().int >> 1
    return [EmbeddingKey("claims", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(base + i)) for i in range(n)]


def test_a_lease_key_is_never_an_entry_key() -> None:
    [k] = fresh(1)
    with pytest.raises(InvalidKey):
        EmbeddingKey.from_key(lease_key(k.to_key()))
    assert lease_key(k.to_key()).endswith(LEASE_SUFFIX)


def test_of_two_clients_one_wins_and_the_other_waits_for_the_entry(make: Any, wait: float) -> None:
    a, b = make(), make()
    assert isinstance(a, ClaimingCache) and a.claim_wait == wait
    a_before, b_before = a.stats(), b.stats()
    keys = fresh(3)
    assert a.claim(keys) == [Claim.WON] * 3
    assert b.claim(keys) == [Claim.HELD] * 3
    value = torch.arange(6.0)
    assert a.insert_batch(keys[:2], [value, value + 1]) == [True, True]
    a.release(keys)
    start = time.monotonic()
    got = b.wait_for_embeddings(keys)
    took = time.monotonic() - start
    assert got[0] is not None and torch.equal(got[0], value)
    assert got[1] is not None and torch.equal(got[1], value + 1)
    assert got[2] is None  # released unwritten: the wait learns it (no claim stands), the caller encodes
    assert took < wait, "a claim released unwritten ends the wait before its bound"
    assert delta(b, b_before) == {"claims_won": 0, "waits_served": 2, "waits_timed_out": 1, "coalesced": 2}
    assert delta(a, a_before)["claims_won"] == 3
    # released: the key can be claimed again (the revoke runs on the metadata lane first)
    assert wait_until(lambda: b.claim(keys[2:]) == [Claim.WON], 5.0)


def test_callers_of_one_cache_coalesce_and_a_release_wakes_them(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = make(claim_wait=5.0)
    [k] = fresh(1)
    assert a.claim([k]) == [Claim.WON]
    assert a.claim([k]) == [Claim.HELD]  # another caller of this cache: no store call needed
    got: list[torch.Tensor | None] = []
    pausing = threading.Event()
    pause = a._claims._pause

    def noted_pause(seconds: float) -> None:
        pausing.set()
        pause(seconds)

    monkeypatch.setattr(a._claims, "_pause", noted_pause)

    def waiter() -> None:
        got.extend(a.wait_for_embeddings([k]))

    thread = threading.Thread(target=waiter)
    thread.start()
    assert pausing.wait(5.0)  # the waiter looked once, found nothing, and waits
    a.insert_batch([k], [torch.ones(4)])
    started = time.monotonic()
    a.release([k])
    thread.join(5.0)
    assert time.monotonic() - started < 1.0
    assert len(got) == 1 and got[0] is not None and torch.equal(got[0], torch.ones(4))


def test_a_won_key_whose_entry_landed_meanwhile_is_held_not_encoded(make: Any) -> None:
    a, b = make(), make()
    before = a.stats()
    [k] = fresh(1)
    assert b.insert_batch([k], [torch.zeros(3)]) == [True]
    assert a.claim([k]) == [Claim.HELD]
    [got] = a.wait_for_embeddings([k])
    assert got is not None and torch.equal(got, torch.zeros(3))
    assert delta(a, before)["claims_won"] == 0


def test_claims_off_answer_unclaimed_and_never_wait(make: Any) -> None:
    a, b = make(claim_wait=0), make(claim_wait=0)
    keys = fresh(2)
    assert a.claim(keys) == b.claim(keys) == [Claim.UNCLAIMED] * 2
    assert b.wait_for_embeddings(keys) == [None, None]
    assert a.claim_wait == 0.0


def test_a_stale_session_of_this_client_is_revoked_and_claimed_again(make: Any) -> None:
    a = make()
    [k] = fresh(1)
    lease = lease_key(k.to_key())
    opened = a._transport.meta(
        lambda store: store.batch_put_session_start([lease], [8]), time.monotonic() + 5
    )
    assert opened == Done([0])  # as if a revoke had failed: this client holds the session, no caller does
    assert a.claim([k]) == [Claim.WON]


def test_a_squatters_lease_costs_a_waiter_the_bound_and_counts_as_timed_out(make: Any, wait: float) -> None:
    a, squatter = make(), make()
    [k] = fresh(1)
    lease = lease_key(k.to_key())
    opened = squatter._transport.meta(
        lambda store: store.batch_put_session_start([lease], [8]), time.monotonic() + 5
    )
    assert opened == Done([0])
    before = a.stats()
    assert a.claim([k]) == [Claim.HELD]
    start = time.monotonic()
    assert a.wait_for_embeddings([k]) == [None]
    assert wait - 0.05 <= time.monotonic() - start < wait + 1.5
    assert delta(a, before)["waits_timed_out"] == 1


def test_a_lease_key_written_as_an_object_is_unclaimed_at_once(make: Any) -> None:
    a, squatter = make(), make()
    [k] = fresh(1)
    assert squatter._transport.meta(
        lambda store: store.put(lease_key(k.to_key()), b"squat"), time.monotonic() + 5
    ) == Done(0)
    assert a.claim([k]) == [Claim.UNCLAIMED]


def test_a_master_fault_is_unclaimed_never_a_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(
            master_server_address=master.address, global_segment_size=0, local_buffer_size=4 * MiB
        )
        with MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore, clock=clock) as cache:
            monkeypatch.setattr(cache._claims, "_pause", clock.advance)  # a wait would move the clock
            keys = fresh(2)
            master.fail_next("batch_put_session_start", code=-900)
            assert cache.claim(keys[:1]) == [Claim.UNCLAIMED]
            assert cache.health().breaker_open, "a master that did not answer is a master fault"
            assert cache.claim(keys) == [Claim.UNCLAIMED] * 2
            master.kill()
            start = clock()
            assert cache.wait_for_embeddings(keys) == [None, None]
            assert clock() == start, "no wait on a failing master"
            assert cache.stats().waits_timed_out == 2


class _Clock:
    """An injected clock: pauses advance it instead of sleeping."""

    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def test_a_wait_backs_off_and_never_passes_its_bound() -> None:
    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(master_server_address=master.address, local_buffer_size=4 * MiB)
        with MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore) as cache:
            texts = [k.to_key() for k in fresh(2)]
            squatter = a_client(master)  # holds the claims and never writes
            assert squatter.batch_put_session_start([lease_key(t) for t in texts], [8, 8]) == [0, 0]
            clock = _Clock()
            claims = Claims(cache._parts, clock=clock, pause=clock.pause)
            landed = claims.wait(texts, 1.0)
            assert landed == set()
            assert clock.now == pytest.approx(101.0)  # the last pause is cut to the bound
            assert clock.pauses[0] == pytest.approx(0.002)
            assert all(b >= a for a, b in zip(clock.pauses[:-2], clock.pauses[1:-1], strict=True))
            assert max(clock.pauses) <= POLL_MAX_S + 1e-9
            looks = master.calls["batch_is_exist"]
            assert 90 <= looks <= 110  # a few ms apart, backing off to 10 ms: about 100 looks a second
            probes = master.calls["batch_put_session_start"] - 1  # less the squatter's
            assert 1 / PROBE_EVERY_S - 2 <= probes <= 1 / PROBE_EVERY_S  # does a claim still stand?
            assert squatter.batch_put_session_start([lease_key(texts[0])], [8]) == [INVALID_PARAMS]
            squatter.close()


def test_a_wait_whose_entries_all_landed_returns_without_a_pause() -> None:
    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(master_server_address=master.address, local_buffer_size=4 * MiB)
        with MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore) as cache:
            texts = [k.to_key() for k in fresh(2)]
            writer = a_client(master)
            assert [writer.upsert(text, b"entry") for text in texts] == [0, 0]
            clock = _Clock()
            claims = Claims(cache._parts, clock=clock, pause=clock.pause)
            assert claims.wait(texts, 1.0) == set(texts)
            assert clock.pauses == [], "nothing left to wait for"
            writer.close()


def a_client(master: FakeMooncakeMaster) -> FakeMooncakeStore:
    """Another client of `master` (lending no memory)."""
    store = FakeMooncakeStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 * MiB, "tcp", "", master.address) == 0
    return store


def test_a_claim_released_unwritten_ends_the_wait_at_the_next_probe() -> None:
    """The claimant's put failed (its holder paused, say): it releases, and its waiter stops
    waiting by the next probe of the clock, not at the bound, and encodes."""
    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(master_server_address=master.address, local_buffer_size=4 * MiB)
        with MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore) as cache:
            texts = [k.to_key() for k in fresh(2)]
            leases = [lease_key(t) for t in texts]
            claimant = a_client(master)
            assert claimant.batch_put_session_start(leases, [8, 8]) == [0, 0]
            clock = _Clock()
            gives_up_at = clock.now + 0.3

            def pause(seconds: float) -> None:
                clock.pause(seconds)
                if clock.now >= gives_up_at and master.reserved():
                    assert claimant.upsert(texts[0], b"entry") == 0  # written, then released
                    claimant.batch_put_session_revoke(leases)  # the other released unwritten

            claims = Claims(cache._parts, clock=clock, pause=pause)
            start = clock.now
            landed = claims.wait(texts, 2.0)
            assert landed == {texts[0]}, "an entry written before its release is landed, not freed"
            assert clock.now - start <= 0.3 + PROBE_EVERY_S + POLL_MAX_S + 1e-9
            assert master.reserved() == [], "the probe's own sessions are revoked"
            claimant.close()


def test_a_dead_claimants_lease_is_claimable_again_once_the_master_discards_it() -> None:
    clock = FakeClock()  # the master's: its discard time passes when the test says so
    with FakeMooncakeMaster(put_start_discard_timeout_s=30.0, clock=clock) as master:

        def cache(segment: int = 16 * MiB) -> MooncakeCache:
            config = MooncakeConfig(
                master_server_address=master.address,
                global_segment_size=segment,
                local_buffer_size=4 * MiB,
                claim_wait=0.2,
            )
            return MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore)

        [k] = fresh(1)
        with cache() as holder, cache() as other:
            dying = cache(segment=0)  # a pure client: its lease's room is on a holder that stays
            assert dying.claim([k]) == [Claim.WON]
            dying.close()  # dies holding the lease: nothing revokes it
            assert lease_key(k.to_key()) in master.reserved()
            assert other.claim([k]) == [Claim.HELD]
            assert other.wait_for_embeddings([k]) == [None]  # the bound, then the caller encodes
            clock.advance(29.5)
            assert other.claim([k]) == [Claim.HELD], "still within the discard time"
            # the master discards the dead one's lease after its discard time: then it is won
            clock.advance(0.5)
            assert other.claim([k]) == [Claim.WON]
            other.release([k])
            assert wait_until(lambda: lease_key(k.to_key()) not in master.reserved(), 5.0)
            assert holder.claim([k]) == [Claim.WON]
            holder.release([k])


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_claim_wait_must_be_finite_and_not_negative(value: float) -> None:
    with pytest.raises(ValueError, match="claim_wait"):
        MooncakeConfig(master_server_address="127.0.0.1:50051", claim_wait=value)


def test_claim_wait_defaults_to_two_seconds_and_reads_mmkey_claim_wait() -> None:
    assert MooncakeConfig(master_server_address="127.0.0.1:50051").claim_wait == 2.0
    with pytest.raises(TypeError, match="claim_wait"):
        MooncakeConfig(master_server_address="127.0.0.1:50051", claim_wait=True)
    env = {"MOONCAKE_MASTER": "127.0.0.1:50051", "MMKEY_CLAIM_WAIT": "0.75"}
    assert MooncakeConfig.from_env(env).claim_wait == 0.75
    assert MooncakeConfig.from_env({**env, "MMKEY_CLAIM_WAIT": "0"}).claim_wait == 0.0
    with pytest.raises(ValueError, match="MMKEY_CLAIM_WAIT"):
        MooncakeConfig.from_env({**env, "MMKEY_CLAIM_WAIT": "soon"})


@pytest.mark.mooncake
def test_on_a_real_master_a_dead_claimants_lease_is_claimable_after_the_discard_time() -> None:
    _require_master()
    with running_master(extra_args=("--put_start_discard_timeout_sec=2",)) as master:

        def cache(segment: int = 16 * MiB) -> MooncakeCache:
            config = MooncakeConfig(
                master_server_address=master.address,
                global_segment_size=segment,
                local_buffer_size=4 * MiB,
                timeout=5.0,
                claim_wait=0.2,
            )
            return MooncakeCache(config, keyring=None)

        [k] = fresh(1)
        with cache() as other:
            dying = cache(segment=0)  # a pure client: its lease's room is on the other's segment
            assert dying.claim([k]) == [Claim.WON]
            dying.close()  # its sessions are not revoked: the lease stays reserved
            assert other.claim([k]) == [Claim.HELD]
            assert other.wait_for_embeddings([k]) == [None]
            assert wait_until(lambda: other.claim([k]) == [Claim.WON], 10.0)  # discarded after 2 s
            other.release([k])
