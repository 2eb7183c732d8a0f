"""Logic of `MooncakeCache` on the fake store (`mmkey.testing.fake_mooncake`): faults injected
exactly where a real master and holders can only be made to fail by chance or by timing.

The real-master tests (test_mooncake_cache.py, test_mooncake_edges.py, test_mooncake_fleet.py)
stay the reference; the fake answers as the real binding does (test_mooncake_contract.py runs
the same assertions against both).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig, mm_hash
from mmkey.cache.health import CacheHealth
from mmkey.entry.codec import encode_entry
from mmkey.testing.fake_mooncake import (
    RPC_FAIL,
    TRANSFER_FAIL,
    FakeMooncakeMaster,
    FakeMooncakeStore,
)
from tests._support import wait_until

MiB = 1 << 20


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("fake-model", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


@pytest.fixture
def master() -> Iterator[FakeMooncakeMaster]:
    with FakeMooncakeMaster() as m:
        yield m


def make_cache(master: FakeMooncakeMaster, **overrides: object) -> MooncakeCache:
    settings: dict[str, object] = {
        "global_segment_size": 64 * MiB,
        "local_buffer_size": 8 * MiB,
        "timeout": 2.0,  # ample on a loaded host; cut-offs come from injected faults
        "retry_after": 30.0,
    }
    settings.update(overrides)
    address = master.address
    config = MooncakeConfig(master_server_address=address, **settings)  # type: ignore[arg-type]
    return MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore)


@pytest.fixture
def cache(master: FakeMooncakeMaster) -> Iterator[MooncakeCache]:
    with make_cache(master) as c:
        yield c


class Holder:
    """A segment holder beside the cache (a process of its own in production): a fake client
    lending a segment, whose writes land in it."""

    def __init__(self, master: FakeMooncakeMaster) -> None:
        self.store = FakeMooncakeStore()
        segment = 16 * MiB
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment, segment, "tcp", "", master.address)
        assert rc == 0
        self.endpoint = self.store.get_hostname()

    def write(self, k: EmbeddingKey, tensor: torch.Tensor) -> None:
        assert self.store.upsert(k.to_key(), encode_entry(k.to_key(), tensor)) == 0


@pytest.fixture
def holders(master: FakeMooncakeMaster) -> Iterator[tuple[Holder, Holder]]:
    pair = (Holder(master), Holder(master))
    yield pair
    for h in pair:
        h.store.close()


def one_on_each(holders: tuple[Holder, Holder], first: int) -> tuple[EmbeddingKey, EmbeddingKey]:
    """Keys `first` and `first + 1`, the one's entry (ones) on the first holder, the other's on
    the second."""
    a, b = key(first), key(first + 1)
    holders[0].write(a, torch.ones(4))
    holders[1].write(b, torch.ones(4))
    return a, b


def test_round_trip_through_every_path(cache: MooncakeCache, master: FakeMooncakeMaster) -> None:
    keys = [key(1), key(2)]
    tensors = [torch.randn(4, 8), torch.arange(6, dtype=torch.int32)]
    assert cache.insert_batch(keys, tensors) == [True, True]
    assert sorted(master.keys()) == sorted(k.to_key() for k in keys)
    assert master.calls["batch_upsert_from"] == 1  # staged and sent in one batch
    assert cache.batch_is_exist([*keys, key(3)]) == [True, True, False]
    got = cache.get_embeddings(keys)
    assert all(g is not None and torch.equal(g, t) for g, t in zip(got, tensors, strict=True))
    target = torch.zeros(4, 8)
    assert cache.read_into([keys[0]], [target]) == [True]
    assert torch.equal(target, tensors[0])
    assert cache.insert_from([key(4)], [[torch.ones(2, 3), torch.zeros(1, 3)]]) == [True]
    joined = cache.get_embeddings([key(4)])[0]
    assert joined is not None
    assert torch.equal(joined, torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.inserts, stats.errors) == (4, 0, 3, 0)


def test_misses_are_counted_and_never_transferred(cache: MooncakeCache, master: FakeMooncakeMaster) -> None:
    assert cache.get_embeddings([key(10), key(10)]) == [None, None]
    assert cache.read_into([key(11)], [torch.zeros(3)]) == [False]
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.errors) == (0, 3, 0)
    assert cache.get_embeddings([]) == [] and cache.batch_is_exist([]) == []
    assert master.calls["batch_get_into"] == 2  # the duplicate key was read once


def test_a_corrupted_entry_is_refused_counted_and_leaves_the_target_alone(
    cache: MooncakeCache, master: FakeMooncakeMaster
) -> None:
    k = key(20)
    assert cache.insert_batch([k], [torch.ones(16)]) == [True]
    master.flip_byte(k.to_key(), offset=-3)  # a payload byte
    assert cache.get_embeddings([k]) == [None]
    target = torch.full((16,), 7.0)
    assert cache.read_into([k], [target]) == [False]
    assert torch.equal(target, torch.full((16,), 7.0))
    stats = cache.stats()
    assert (stats.corrupt, stats.hits, stats.misses) == (2, 0, 2)
    assert cache.insert_batch([k], [torch.ones(16)]) == [True]  # an upsert replaces it
    assert cache.get_embeddings([k])[0] is not None


@pytest.mark.parametrize(
    ("method", "call"),
    [
        ("batch_is_exist", lambda c: c.batch_is_exist([key(30)]) == [False]),
        ("batch_get_into", lambda c: c.get_embeddings([key(30)]) == [None]),
        ("batch_upsert_from", lambda c: c.insert_batch([key(31)], [torch.ones(2)]) == [False]),
    ],
)
def test_a_master_fault_is_a_counted_miss_and_opens_the_breaker(
    master: FakeMooncakeMaster, method: str, call: object
) -> None:
    with make_cache(master) as cache:
        assert cache.insert_batch([key(30)], [torch.ones(2)]) == [True]
        master.fail_next(method, code=RPC_FAIL)
        assert callable(call) and call(cache)
        assert cache.stats().errors == 1
        assert cache.health().breaker_open and not cache.is_connected()
        before = sum(master.calls.values())
        assert cache.get_embeddings([key(30)]) == [None]  # answered without the store
        assert sum(master.calls.values()) == before
        assert cache.stats().skipped == 1


def test_the_breaker_closes_after_one_trial_call_succeeds(master: FakeMooncakeMaster) -> None:
    with make_cache(master, retry_after=0.05) as cache:
        assert cache.insert_batch([key(40)], [torch.ones(2)]) == [True]
        master.fail_next("batch_is_exist", code=RPC_FAIL)
        assert cache.batch_is_exist([key(40)]) == [False]
        assert cache.health().breaker_open
        assert wait_until(lambda: cache.batch_is_exist([key(40)]) == [True], 10)
        assert not cache.health().breaker_open and cache.is_connected()
        got = cache.get_embeddings([key(40)])[0]
        assert got is not None and torch.equal(got, torch.ones(2))


def test_a_master_slow_to_answer_the_probe_is_not_taken_for_dead(master: FakeMooncakeMaster) -> None:
    # after a timed-out call the cache asks the master before the next one; on a busy host a
    # live master's answer can take longer than 0.2 s, and that must not open the breaker (the
    # timeout leaves the read after the probe seconds, even on a loaded host)
    with make_cache(master, timeout=4.0) as cache:
        assert cache.insert_batch([key(55)], [torch.ones(2)]) == [True]
        master.delay("batch_get_into", 5.0)
        assert cache.get_embeddings([key(55)]) == [None]  # cut off: the master is now suspect
        master.delay("batch_get_into", 0)
        # the cut-off transfer completes: its lane is free and its holder re-admitted
        assert wait_until(lambda: cache.health() == CacheHealth(), 10), cache.health()
        master.delay("ping", 0.5)
        got = cache.get_embeddings([key(55)])[0]
        assert got is not None and torch.equal(got, torch.ones(2))
        assert not cache.health().breaker_open
        master.delay("ping", 0)


def test_a_lookup_that_gave_up_queued_behind_others_does_not_open_the_breaker(
    master: FakeMooncakeMaster, holders: tuple[Holder, Holder]
) -> None:
    # the metadata lane is shared by every caller: a lookup cut off while it still waited for
    # the lane never reached the master, which says nothing about the master
    paused, _ = holders
    a, b = one_on_each(holders, 90)
    with make_cache(master, global_segment_size=0, timeout=2.0, retry_after=3600.0) as cache:
        master.pause_holder(paused.endpoint)
        master.delay("batch_get_replica_desc", 4.0)
        # cut off; which holder failed is then asked on the metadata lane (4 s, in the background)
        assert cache.get_embeddings([a]) == [None]
        # this read asks which holder holds `b` first: its lookup waits behind that one, in vain
        assert cache.get_embeddings([b]) == [None]
        assert not cache.health().breaker_open
        master.delay("batch_get_replica_desc", 0)
        assert wait_until(lambda: cache.get_embeddings([b])[0] is not None, 10)
        master.resume_holder(paused.endpoint)


def test_a_paused_holder_is_quarantined_and_its_late_transfer_lands_in_staging_only(
    master: FakeMooncakeMaster, holders: tuple[Holder, Holder]
) -> None:
    paused, healthy = holders
    a, b = key(60), key(61)
    paused.write(a, torch.ones(4))
    healthy.write(b, torch.full((4,), 2.0))
    with make_cache(master, global_segment_size=0, timeout=2.0, retry_after=0.05) as cache:
        master.pause_holder(paused.endpoint)
        target = torch.zeros(4)
        assert cache.read_into([a], [target]) == [False]  # cut off at the deadline
        assert wait_until(lambda: cache.health().quarantined == (paused.endpoint,), 10)
        reads = master.calls["batch_get_into"]
        assert cache.get_embeddings([a, b])[0] is None  # bound for the quarantined holder
        got = cache.get_embeddings([b])[0]
        assert got is not None and torch.equal(got, torch.full((4,), 2.0))
        assert master.calls["batch_get_into"] == reads + 2  # only the healthy holder was read
        master.resume_holder(paused.endpoint)  # the stuck transfer lands now, late
        assert torch.equal(target, torch.zeros(4))  # ... in staging, never in the caller's target
        assert wait_until(lambda: cache.get_embeddings([a])[0] is not None, 10)  # re-admitted
        assert cache.health().quarantined == ()


def transfers_are(master: FakeMooncakeMaster, count: int) -> bool:
    return master.calls["batch_get_into"] == count


def test_only_holders_that_were_asked_are_quarantined_and_a_late_answer_readmits_them(
    master: FakeMooncakeMaster, holders: tuple[Holder, Holder]
) -> None:
    paused, healthy = holders
    stuck_keys, b = [key(80), key(81), key(82)], key(83)
    for k in stuck_keys:
        paused.write(k, torch.ones(4))
    healthy.write(b, torch.full((4,), 2.0))
    # A timeout long enough for the three readers to be under way together on a loaded host
    # (one cut off before the others start quarantines the holder, and they never ask it):
    # each starts once the one before has its transfer stuck.
    with make_cache(master, global_segment_size=0, timeout=8.0, retry_after=3600.0) as cache:
        master.pause_holder(paused.endpoint)
        readers = [threading.Thread(target=cache.get_embeddings, args=([k],)) for k in stuck_keys]
        for started, t in enumerate(readers, 1):
            t.start()  # one transfer per lane, each stuck on the paused holder
            assert wait_until(partial(transfers_are, master, started), 6), master.calls
        # every lane busy within its timeout: this read queues behind one and gives up before
        # its transfer starts, so the healthy holder was never asked and is not to blame
        assert cache.get_embeddings([b]) == [None]
        for t in readers:
            t.join(20)
        assert wait_until(lambda: cache.health().quarantined == (paused.endpoint,), 10)
        cache.batch_is_exist([b])  # behind any lookup that would quarantine a holder
        assert cache.health().quarantined == (paused.endpoint,)
        assert master.calls["batch_get_into"] == len(stuck_keys)
        master.resume_holder(paused.endpoint)  # the stuck transfers complete, late
        # that alone re-admits the holder: no probe is due for an hour
        assert wait_until(lambda: cache.health().quarantined == (), 10)
        got = cache.get_embeddings([*stuck_keys, b])
        assert all(g is not None for g in got)


def test_an_unreachable_holder_is_quarantined_then_readmitted(
    master: FakeMooncakeMaster, holders: tuple[Holder, Holder]
) -> None:
    lost, _ = holders
    a, b = one_on_each(holders, 70)
    with make_cache(master, global_segment_size=0, retry_after=0.05) as cache:
        master.make_unreachable(lost.endpoint)
        assert cache.get_embeddings([a])[0] is None
        assert wait_until(lambda: cache.health().quarantined == (lost.endpoint,), 10)
        assert cache.get_embeddings([b])[0] is not None
        assert not cache.health().breaker_open  # a holder fault is not the master's
        master.make_unreachable(lost.endpoint, False)
        assert wait_until(lambda: cache.get_embeddings([a])[0] is not None, 10)
        assert cache.health().quarantined == ()
        assert cache.stats().skipped >= 1  # reads of `a` while quarantined: no transfer


def test_a_holder_that_left_takes_its_entries_with_it(
    master: FakeMooncakeMaster, holders: tuple[Holder, Holder]
) -> None:
    leaving, staying = holders
    leaving.write(key(80), torch.ones(2))
    staying.write(key(81), torch.ones(2))
    with make_cache(master, global_segment_size=0) as cache:
        assert cache.batch_is_exist([key(80), key(81)]) == [True, True]
        leaving.store.close()
        assert cache.batch_is_exist([key(80), key(81)]) == [False, True]
        assert cache.get_embeddings([key(80)]) == [None]
        assert cache.stats().errors == 0


def test_a_killed_master_gives_misses_and_a_restarted_one_is_rejoined(
    master: FakeMooncakeMaster,
) -> None:
    with make_cache(master, retry_after=0.05) as cache:
        assert cache.insert_batch([key(90)], [torch.ones(2)]) == [True]
        master.kill()
        assert cache.get_embeddings([key(90)]) == [None]
        assert cache.insert_batch([key(90)], [torch.ones(2)]) == [False]
        assert cache.batch_is_exist([key(90)]) == [False]
        assert cache.stats().errors >= 1 and not cache.is_connected()
        master.restart()
        assert wait_until(lambda: cache.insert_batch([key(91)], [torch.ones(2)]) == [True], 10)
        assert cache.get_embeddings([key(90)]) == [None]  # a restarted master lost every key
        assert cache.get_embeddings([key(91)])[0] is not None


def test_an_entry_larger_than_the_reader_allows_is_never_transferred(
    master: FakeMooncakeMaster, holders: tuple[Holder, Holder]
) -> None:
    holder, _ = holders
    k = key(100)
    holder.write(k, torch.ones(256 * 1024))  # 1 MiB of payload
    with make_cache(master, global_segment_size=0, max_entry_size=64 * 1024) as cache:
        assert cache.get_embeddings([k]) == [None]
        assert cache.stats().oversized == 1
        assert master.calls["get_into"] == 0  # its size was asked, its bytes never read


def test_transfer_fail_on_a_write_is_a_counted_false(
    cache: MooncakeCache, master: FakeMooncakeMaster
) -> None:
    master.fail_next("batch_upsert_from", code=TRANSFER_FAIL)
    assert cache.insert_batch([key(110)], [torch.ones(2)]) == [False]
    assert cache.insert_batch([key(110)], [torch.ones(2)]) == [True]
    assert cache.stats().inserts == 1


def test_the_fault_hooks_of_the_fake(master: FakeMooncakeMaster) -> None:
    from mmkey.cache.mooncake._net import master_answers, parse_host_port

    host, port = parse_host_port(master.address)
    assert master_answers(host, port, 1.0)
    store = FakeMooncakeStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", MiB, MiB, "tcp", "", master.address) == 0
    assert store.put("k", b"value") == 0
    master.fail_next("get_size", code=-901, times=2)
    assert [store.get_size("k") for _ in range(3)] == [-901, -901, 5]
    master.flip_byte("k", offset=0)
    assert store.get("k") == bytes([ord("v") ^ 0xFF]) + b"alue"
    with pytest.raises(KeyError):
        master.flip_byte("absent")
    assert master.holders_of("k") == [store.get_hostname()] == master.holders()
    master.kill()
    assert not master_answers(host, port, 1.0)
    assert store.health_check() == 2 and store.get_size("k") == RPC_FAIL
    master.restart()
    assert master_answers(host, port, 1.0) and store.get("k") == b""
    assert store.close() == 0 and master.holders() == []
    nowhere = FakeMooncakeStore()  # no fake master listens there
    assert nowhere.setup("127.0.0.1", "P2PHANDSHAKE", MiB, MiB, "tcp", "", "127.0.0.1:1") != 0


def test_replicas_go_to_distinct_holders(master: FakeMooncakeMaster, holders: tuple[Holder, Holder]) -> None:
    pytest.importorskip("mooncake.store")  # the cache's placement settings are the binding's class
    with make_cache(master, global_segment_size=0, replica_num=2) as cache:
        assert cache.insert_batch([key(120)], [torch.ones(3)]) == [True]
        assert sorted(master.holders_of(key(120).to_key())) == sorted(h.endpoint for h in holders)
        got = cache.get_embeddings([key(120)])[0]
        assert got is not None and torch.equal(got, torch.ones(3))


def test_a_mixed_burst_of_refused_entries_is_logged_whole_in_one_line(
    master: FakeMooncakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    import hashlib
    import logging

    from mmkey.entry.auth import EntryKeyring

    ours = EntryKeyring.from_secrets(hashlib.sha256(b"ours").hexdigest())
    theirs = EntryKeyring.from_secrets(hashlib.sha256(b"theirs").hexdigest())
    settings = {"global_segment_size": 64 * MiB, "local_buffer_size": 8 * MiB, "timeout": 2.0}
    config = MooncakeConfig(master_server_address=master.address, **settings)  # type: ignore[arg-type]
    raw = FakeMooncakeStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", master.address) == 0
    t = torch.randn(4, 8)
    entries = {
        key(900).to_key(): encode_entry(key(900).to_key(), t),  # unsigned
        key(901).to_key(): encode_entry(key(901).to_key(), t),  # unsigned
        key(902).to_key(): encode_entry(key(902).to_key(), t, keyring=theirs),  # unknown_key
        key(903).to_key(): encode_entry(key(904).to_key(), t, keyring=ours),  # bad_mac: another key's
        key(905).to_key(): b"not an entry at all",
    }
    for text, entry in entries.items():
        assert raw.upsert(text, entry) == 0
    caplog.set_level(logging.WARNING, logger="mmkey.cache.mooncake")
    with MooncakeCache(config, keyring=ours, store_class=FakeMooncakeStore) as reader:
        assert reader.get_embeddings([key(i) for i in (900, 901, 902, 903, 905)]) == [None] * 5
        stats = reader.stats()
    lines = [r.getMessage() for r in caplog.records if "did not verify" in r.getMessage()]
    assert len(lines) == 1, lines
    [line] = lines
    assert stats.forged == 5
    kinds = {"unsigned": stats.unsigned, "unknown_key": stats.unknown_key, "bad_mac": stats.bad_mac}
    for reason, n in kinds.items():
        if n:
            assert f"{n} forged ({reason})" in line  # every kind, with its count
    assert sum(kinds.values()) == 5 and len([n for n in kinds.values() if n]) >= 3


def test_a_write_to_a_paused_holder_lands_on_resume_and_to_an_unreachable_one_changes_nothing(
    master: FakeMooncakeMaster,
) -> None:
    # as with a real stopped holder, a put placed on it waits; an unreachable one fails the put
    holder = Holder(master)
    client = FakeMooncakeStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", master.address) == 0
    try:
        master.pause_holder(holder.endpoint)
        answers: list[int] = []
        writer = threading.Thread(target=lambda: answers.append(client.upsert("k", b"v" * 8)))
        writer.start()
        assert wait_until(lambda: master.calls["upsert"] == 1, 10), "the put reached the master"
        writer.join(0.2)  # a put that did not wait would be done by now (it is a dict update)
        assert writer.is_alive() and master.keys() == [], "waiting on the paused holder, nothing stored"
        master.resume_holder(holder.endpoint)
        writer.join(10)
        assert answers == [0] and master.value("k") == b"v" * 8
        master.make_unreachable(holder.endpoint)
        assert client.upsert("k", b"w" * 8) == TRANSFER_FAIL
        assert client.upsert("k2", b"w" * 8) == TRANSFER_FAIL
        assert master.keys() == ["k"] and master.value("k") == b"v" * 8, "the old value kept"
    finally:
        client.close()
        holder.store.close()
