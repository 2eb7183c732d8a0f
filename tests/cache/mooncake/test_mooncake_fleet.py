"""MooncakeCache against a real fleet: a master and two segment-holder processes, one of
which is paused, killed or partitioned while readers (threads and asyncio) keep reading.

Every call returns within the timeout plus scheduling slack; entries on the healthy holder
keep hitting; reads bound for the failed holder are answered at once after the first failure;
with two replicas no entry is lost when either holder dies; no wrong tensor is ever served;
the reader recovers by itself. Time bounds only catch hangs (a stuck transfer lasts 30 s).

One binding fact is pinned here because it rules out zero-copy reads under a timeout: a read
into a registered buffer that is stuck on a paused holder writes the whole buffer once the holder
resumes, however long after the caller stopped waiting (measured on 0.3.13.post1: an 8 MiB read
stuck 2 s landed in full within 0.3 s of the resume).
"""

from __future__ import annotations

import asyncio
import ctypes
import statistics
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, mm_hash
from mmkey.cache.aio import AsyncCache
from mmkey.cache.mooncake._net import PROGRESS_ENV
from mmkey.cache.protocol import Claim
from mmkey.testing.fleet import (
    Fleet,
    HolderProcess,
    replica_endpoints,
    running_fleet,
)
from mmkey.testing.pytest_plugin import _require_fleet
from tests._support import raw_client, wait_until

pytestmark = pytest.mark.mooncake

TIMEOUT = 1.0
"""The readers' timeout: a read stuck on a failed holder is cut off here. Far above a healthy
read (about a millisecond on loopback), also on a host saturated by other work, where a 0.3 s
one left a live master's lookups timing out and the healthy holder's entries missing."""
SLACK = 1.5
QUICK = 0.05
"""Reads bound for a quarantined holder: answered without a transfer."""
DROP_TTL_S = 4
"""The master's client TTL in tests that wait for it to drop a killed or paused holder (its
own default is 10 s): such a test waits that long once."""
DROPS_A_HOLDER = pytest.mark.parametrize("mooncake_fleet", [DROP_TTL_S], indirect=True, ids=["ttl4"])


def fleet_of(holders: int, client_ttl: int | None = None) -> Iterator[Fleet]:
    _require_fleet()  # skips (fails under MMKEY_REQUIRE_MOONCAKE) as the plugin's fixtures do
    with running_fleet(holders=holders, client_ttl=client_ttl) as fleet:
        yield fleet


@pytest.fixture
def mooncake_fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """A master and two holders for one test, as the plugin's fixture of that name; tests
    marked `DROPS_A_HOLDER` get a master with a client TTL of `DROP_TTL_S`."""
    yield from fleet_of(2, client_ttl=getattr(request, "param", None))


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("fleet", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


def value(i: int) -> torch.Tensor:
    return torch.full((256,), float(i))


@pytest.fixture
def store(mooncake_fleet: Fleet) -> Iterator[object]:
    """A pure client of the fleet on the raw binding, to see where entries landed."""
    with raw_client(mooncake_fleet.client_config()) as client:
        yield client


def write(fleet: Fleet, keys: list[EmbeddingKey], replica_num: int = 1) -> MooncakeCache:
    writer = MooncakeCache(fleet.client_config(timeout=30.0, replica_num=replica_num))
    assert writer.insert_batch(keys, [value(k.digest) for k in keys]) == [True] * len(keys)
    return writer


def placement(
    fleet: Fleet, store: object, keys: list[EmbeddingKey]
) -> dict[EmbeddingKey, list[HolderProcess]]:
    where = replica_endpoints(store, [k.to_key() for k in keys])
    found: dict[EmbeddingKey, list[HolderProcess]] = {}
    for k in keys:
        holders = [fleet.holder_of(e) for e in where[k.to_key()]]
        assert holders and all(h is not None for h in holders), (k, where[k.to_key()])
        found[k] = [h for h in holders if h is not None]
    return found


def reader_of(fleet: Fleet, **overrides: object) -> MooncakeCache:
    fields: dict[str, object] = {"timeout": TIMEOUT, "retry_after": 0.5}
    fields.update(overrides)
    return MooncakeCache(fleet.client_config(**fields))


class Sweep:
    """One pass over the keys, one call per key, with what each call returned and took."""

    def __init__(self, reader: MooncakeCache, keys: list[EmbeddingKey]) -> None:
        self.results: dict[EmbeddingKey, tuple[torch.Tensor | None, float]] = {}
        for k in keys:
            start = time.monotonic()
            got = reader.get_embeddings([k])[0]
            self.results[k] = (got, time.monotonic() - start)

    def hits(self, keys: list[EmbeddingKey]) -> float:
        return sum(self.results[k][0] is not None for k in keys) / max(len(keys), 1)

    def check(self) -> None:
        for k, (got, took) in self.results.items():
            assert took < TIMEOUT + SLACK, (k, took)
            assert got is None or torch.equal(got, value(k.digest)), k


def split(
    where: dict[EmbeddingKey, list[HolderProcess]], victim: HolderProcess
) -> tuple[list[EmbeddingKey], list[EmbeddingKey]]:
    on_victim = [k for k, holders in where.items() if holders[0] is victim]
    healthy = [k for k, holders in where.items() if holders[0] is not victim]
    assert on_victim and healthy, "the master put every entry on one holder"
    return healthy, on_victim


@pytest.mark.realtime
def test_a_paused_holder_never_blinds_a_reader(mooncake_fleet: Fleet, store: object) -> None:
    keys = [key(i) for i in range(100)]
    writer = write(mooncake_fleet, keys)
    reader = reader_of(mooncake_fleet)
    try:
        healthy, on_victim = split(placement(mooncake_fleet, store, keys), mooncake_fleet.holders[0])
        # the precondition (every entry readable before the pause): on a crowded host a read can
        # miss its timeout and quarantine a holder for a while, so it is asked again, bounded
        assert wait_until(lambda: Sweep(reader, keys).hits(keys) == 1.0, 30), reader.health()
        mooncake_fleet.holders[0].pause()
        sweeps = [Sweep(reader, keys) for _ in range(3)]
        for sweep in sweeps:
            sweep.check()
            assert sweep.hits(healthy) >= 0.9, [s.hits(healthy) for s in sweeps]
        # after the first failure, reads bound for the paused holder are answered at once
        later = [took for s in sweeps[1:] for k, (_, took) in s.results.items() if k in on_victim]
        assert statistics.median(later) < QUICK, statistics.median(later)
        health = reader.health()
        assert mooncake_fleet.holders[0].endpoints & set(health.quarantined)
        assert reader.stats().skipped > 0
        mooncake_fleet.holders[0].resume()
        # a reader that keeps reading re-admits the holder by itself (probes ride on reads)
        assert wait_until(lambda: Sweep(reader, keys).hits(keys) == 1.0, 60), reader.health()
        assert reader.health().quarantined == ()
    finally:
        if mooncake_fleet.holders[0].paused:
            mooncake_fleet.holders[0].resume()
        reader.close()
        writer.close()


def test_a_slow_holder_whose_late_transfer_completes_is_readmitted_without_a_probe(
    mooncake_fleet: Fleet, store: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "30")  # the binding's own deadline: the transfer outlives the pause
    # a busy host's healthy holder can miss a short deadline once; its transfer then completes,
    # and that alone re-admits it (probes ride on reads, and none follows here)
    keys = [key(4000 + i) for i in range(40)]
    writer = write(mooncake_fleet, keys)
    reader = reader_of(mooncake_fleet, retry_after=3600.0)
    victim = mooncake_fleet.holders[0]
    try:
        _, on_victim = split(placement(mooncake_fleet, store, keys), victim)
        assert Sweep(reader, keys).hits(keys) == 1.0
        victim.pause()
        assert reader.get_embeddings([on_victim[0]]) == [None]
        assert wait_until(lambda: victim.endpoints & set(reader.health().quarantined), 10), reader.health()
        victim.resume()  # well within Mooncake's 30 s: the stuck transfer completes
        assert wait_until(lambda: reader.health().quarantined == (), 20), reader.health()
        assert Sweep(reader, keys).hits(keys) == 1.0
    finally:
        if victim.paused:
            victim.resume()
        reader.close()
        writer.close()


@DROPS_A_HOLDER
def test_a_killed_holder_costs_one_failure_then_answers_at_once(mooncake_fleet: Fleet, store: object) -> None:
    keys = [key(1000 + i) for i in range(60)]
    writer = write(mooncake_fleet, keys)
    reader = reader_of(mooncake_fleet)
    try:
        healthy, on_victim = split(placement(mooncake_fleet, store, keys), mooncake_fleet.holders[0])
        mooncake_fleet.holders[0].kill()
        sweeps = [Sweep(reader, keys) for _ in range(3)]
        for sweep in sweeps:
            sweep.check()
            assert sweep.hits(healthy) >= 0.9
            assert sweep.hits(on_victim) == 0.0
        later = [took for s in sweeps[1:] for k, (_, took) in s.results.items() if k in on_victim]
        assert statistics.median(later) < QUICK, statistics.median(later)
        # the master drops the dead holder (after its client TTL); its quarantine lifts by itself
        assert mooncake_fleet.wait_segments(1, timeout=60)
        assert wait_until(lambda: (Sweep(reader, keys), reader.health().quarantined)[1] == (), 30)
        final = Sweep(reader, keys)
        final.check()
        assert final.hits(healthy) == 1.0
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("fault", ["kill", "pause"])
@pytest.mark.parametrize("victim_index", [0, 1])
@DROPS_A_HOLDER
def test_two_replicas_lose_nothing_when_either_holder_fails(
    mooncake_fleet: Fleet, store: object, fault: str, victim_index: int
) -> None:
    keys = [key(2000 + i) for i in range(40)]
    writer = write(mooncake_fleet, keys, replica_num=2)
    reader = reader_of(mooncake_fleet)
    victim = mooncake_fleet.holders[victim_index]
    try:
        where = placement(mooncake_fleet, store, keys)
        assert all({h.name for h in holders} == {"holder0", "holder1"} for holders in where.values())
        getattr(victim, fault)()
        for _ in range(2):
            Sweep(reader, keys).check()  # bounded, never a wrong tensor, while the master decides
        assert mooncake_fleet.wait_segments(1, timeout=60)
        assert wait_until(lambda: Sweep(reader, keys).hits(keys) == 1.0, 30), "an entry was lost"
    finally:
        if victim.paused:
            victim.resume()
        reader.close()
        writer.close()


def test_puts_straight_from_registered_pages_place_every_replica(
    mooncake_fleet: Fleet, store: object
) -> None:
    # MooncakeCache.insert_from's multi-buffer put honours replica_num like its upserts
    pool = torch.randn(40 * 8, 16)
    keys = [key(2500 + i) for i in range(40)]
    writer = MooncakeCache(mooncake_fleet.client_config(timeout=30.0, replica_num=2, trusted_network=True))
    try:
        writer.register_memory(pool)
        pages = [[pool[i * 8 : i * 8 + 3], pool[i * 8 + 5 : i * 8 + 8]] for i in range(40)]
        assert writer.insert_from(keys, pages) == [True] * 40
        where = placement(mooncake_fleet, store, keys)
        assert all({h.name for h in holders} == {"holder0", "holder1"} for holders in where.values())
        out = torch.zeros(40 * 6, 16)
        targets = [[out[i * 6 : i * 6 + 6]] for i in range(40)]
        assert writer.read_into(keys, targets) == [True] * 40
        assert torch.equal(out, torch.cat([torch.cat(p) for p in pages]))
    finally:
        writer.close()


def test_thread_and_async_readers_keep_hitting_while_a_holder_is_paused(
    mooncake_fleet: Fleet, store: object
) -> None:
    keys = [key(3000 + i) for i in range(60)]
    writer = write(mooncake_fleet, keys)
    reader = reader_of(mooncake_fleet)
    failures: list[str] = []
    healthy_hits: list[float] = []
    try:
        healthy, _ = split(placement(mooncake_fleet, store, keys), mooncake_fleet.holders[0])
        mooncake_fleet.holders[0].pause()
        Sweep(reader, keys)  # the first failure: the holder is quarantined

        def thread_reader() -> None:
            for _ in range(3):
                sweep = Sweep(reader, keys)
                try:
                    sweep.check()
                except AssertionError as exc:
                    failures.append(repr(exc))
                healthy_hits.append(sweep.hits(healthy))

        async def async_reader() -> None:
            cache = AsyncCache(reader)
            for _ in range(3):
                for k in keys:
                    start = time.monotonic()
                    got = (await cache.get_embeddings([k]))[0]
                    if time.monotonic() - start >= TIMEOUT + SLACK:
                        failures.append(f"async read of {k} took too long")
                    if got is not None and not torch.equal(got, value(k.digest)):
                        failures.append(f"wrong tensor for {k}")

        threads = [threading.Thread(target=thread_reader) for _ in range(3)]
        for t in threads:
            t.start()
        asyncio.run(async_reader())
        for t in threads:
            t.join(120)
        assert failures == []
        assert min(healthy_hits) >= 0.9, healthy_hits
    finally:
        if mooncake_fleet.holders[0].paused:
            mooncake_fleet.holders[0].resume()
        reader.close()
        writer.close()


def test_a_partitioned_holder_is_quarantined_and_readmitted(mooncake_fleet_netns: Fleet) -> None:
    fleet = mooncake_fleet_netns
    keys = [key(4000 + i) for i in range(40)]
    writer = write(fleet, keys)
    reader = reader_of(fleet)
    try:
        with raw_client(fleet.client_config()) as raw:
            healthy, on_victim = split(placement(fleet, raw, keys), fleet.holders[0])
        fleet.holders[0].partition()
        sweeps = [Sweep(reader, keys) for _ in range(2)]
        for sweep in sweeps:
            sweep.check()
            assert sweep.hits(healthy) >= 0.9
        fleet.holders[0].heal()
        assert wait_until(lambda: (Sweep(reader, keys), reader.health().quarantined)[1] == (), 60)
    finally:
        if fleet.holders[0].partitioned:
            fleet.holders[0].heal()
        reader.close()
        writer.close()


@pytest.fixture
def one_holder_fleet() -> Iterator[Fleet]:
    """A master with a single holder: every entry lands on it."""
    yield from fleet_of(1)


def test_an_abandoned_read_still_writes_its_buffer_when_the_holder_resumes(
    one_holder_fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-buffer read stuck on a paused holder writes nothing while it waits and the whole
    buffer once the holder answers. So a caller that gives up at its deadline and hands the buffer
    back (SGLang frees a missed read's pool pages at once) would find it overwritten later: reads
    under a timeout must land in memory the reader keeps until the call returns, then be copied.
    """
    from mooncake.store import MooncakeDistributedStore

    monkeypatch.setenv(PROGRESS_ENV, "30")  # the binding's default, whatever a cache of this process set
    fleet = one_holder_fleet
    holder = fleet.holders[0]
    size, pages = 8 << 20, 8
    page = size // pages
    source = bytearray(bytes(range(256)) * (size // 256))
    target = bytearray(size)
    source_view = (ctypes.c_char * size).from_buffer(source)  # pin both while registered
    target_view = (ctypes.c_char * size).from_buffer(target)
    source_ptr, target_ptr = ctypes.addressof(source_view), ctypes.addressof(target_view)
    client = MooncakeDistributedStore()
    assert client.setup(*fleet.client_config(local_buffer_size=16 << 20).setup_args()) == 0
    results: list[object] = []
    reader = threading.Thread(
        target=lambda: results.append(
            client.batch_get_into_multi_buffers(
                ["late-write"],
                [[target_ptr + i * page for i in range(pages)]],
                [[page] * pages],
            )
        ),
        daemon=True,
    )
    try:
        assert client.register_buffer(source_ptr, size) == 0
        assert client.register_buffer(target_ptr, size) == 0
        assert client.put_from("late-write", source_ptr, size) == 0
        assert fleet.holder_of(replica_endpoints(client, ["late-write"])["late-write"][0]) is holder
        holder.pause()
        try:
            reader.start()
            reader.join(1.5)
            assert reader.is_alive()  # still waiting on the holder ...
            assert target == bytearray(size)  # ... and nothing written yet
        finally:
            holder.resume()
        resumed = time.monotonic()
        reader.join(60)  # a stuck transfer gives up after 30 s
        assert not reader.is_alive()
        landed_after = time.monotonic() - resumed
        assert results == [[size]], results
        assert target == source, f"only part landed ({landed_after:.2f} s after the resume)"
    finally:
        if holder.paused:
            holder.resume()
        if reader.ident is not None:
            reader.join(60)
        if not reader.is_alive():  # never unregister memory the binding may still write
            client.unregister_buffer(target_ptr)
            client.unregister_buffer(source_ptr)
            client.close()


def test_a_write_to_a_paused_holder_holds_writes_off_until_it_lands_late(
    one_holder_fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master places a write, so a client cannot tell that one goes to a hung holder until
    it timed out: then writes are skipped (no transfer spins on the hung holder, no claim
    is taken) until one lands; here the timed-out one, when the holder resumes."""
    monkeypatch.setenv(PROGRESS_ENV, "30")  # the binding's own deadline: the put outlives the pause
    holder = one_holder_fleet.holders[0]
    cache = reader_of(one_holder_fleet, retry_after=3600.0, claim_wait=1.0)
    try:
        assert cache.insert_batch([key(5000)], [value(5000)]) == [True]  # the control
        holder.pause()
        assert cache.insert_batch([key(5001)], [value(5001)]) == [False]  # cut off at the timeout
        assert cache.health().writes_held
        skipped = cache.stats().skipped
        assert cache.insert_batch([key(5002)], [value(5002)]) == [False]
        assert cache.stats().skipped == skipped + 1, "held off: no second transfer to the holder"
        assert cache.claim([key(5003)]) == [Claim.UNCLAIMED]
        holder.resume()  # the timed-out put completes: the holder answers again
        assert wait_until(lambda: not cache.health().writes_held, 20), cache.health()
        assert cache.insert_batch([key(5002)], [value(5002)]) == [True]
        for i in (5000, 5001, 5002):
            got = cache.get_embeddings([key(i)])[0]
            assert got is not None and torch.equal(got, value(i)), i
    finally:
        if holder.paused:
            holder.resume()
        cache.close()
