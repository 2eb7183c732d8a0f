"""MooncakeCache against a real local mooncake_master started by the tests.

The two tests marked `realtime` hold the promise of a hung or absent master in real time; the
same faults timed by a fake clock on the fake store (a slow reconnect, an insert that timed
out) are in test_mooncake_clock.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator

import pytest
import torch

from mmkey import (
    EmbeddingCache,
    EmbeddingKey,
    HashScheme,
    Modality,
    MooncakeCache,
    MooncakeConfig,
    StoreClosed,
    StoreError,
    mm_hash,
)
from mmkey.entry.codec import encode_entry
from mmkey.testing.mooncake_master import MasterProcess
from tests._support import ROOMY_TIMEOUT, local_config, raw_client, timed, wait_until

pytestmark = pytest.mark.mooncake

MiB = 1 << 20
TIMEOUT = 0.3
# a call may overrun its timeout by scheduling noise, never by a store hang (30 s)
BOUND = TIMEOUT + 1.5


def key(i: int, namespace: str = "test-model") -> EmbeddingKey:
    return EmbeddingKey(namespace, Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


def config(master: MasterProcess, **overrides: object) -> MooncakeConfig:
    """A roomy deadline, so that only a hang fails a test on a crowded host (0.3 s missed a
    30 MB round trip there); the tests that fault their master or time a call ask for
    `TIMEOUT`."""
    defaults = {"global_segment_size": 256 * MiB, "local_buffer_size": 32 * MiB, "timeout": ROOMY_TIMEOUT}
    return local_config(master, **{**defaults, **overrides})


@pytest.fixture
def cache(mooncake_master_session: MasterProcess) -> Iterator[MooncakeCache]:
    """A cache on the shared master, which no test faults."""
    c = MooncakeCache(config(mooncake_master_session))
    yield c
    c.close()


def test_is_an_embedding_cache(cache: MooncakeCache) -> None:
    assert isinstance(cache, EmbeddingCache)
    assert cache.is_connected()


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def test_every_dtype_round_trips(cache: MooncakeCache) -> None:
    tensors = [(torch.randn(7, 5) * 50).to(dtype) for dtype in DTYPES]
    tensors += [torch.tensor(3.5), torch.zeros(0, 4), torch.randn(6, 4).T]
    keys = [key(1000 + i) for i in range(len(tensors))]
    assert cache.insert_batch(keys, tensors) == [True] * len(tensors)
    for got, want in zip(cache.get_embeddings(keys), tensors, strict=True):
        assert got is not None
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("nbytes", [64 * 1024, 1 * MiB, 8 * MiB, 30 * MiB])
def test_entries_from_64_kib_to_30_mb_round_trip(cache: MooncakeCache, nbytes: int) -> None:
    t = torch.randn(nbytes // 4 // 1024, 1024)
    k = key(2000 + nbytes)
    assert cache.insert_batch([k], [t]) == [True]
    got = cache.get_embeddings([k])[0]
    assert got is not None and torch.equal(got, t)


def test_results_do_not_alias_each_other_or_the_caller(cache: MooncakeCache) -> None:
    small, large = torch.randn(64, 64), torch.randn(1024, 1024)
    keys = [key(3000), key(3001)]
    cache.insert_batch(keys, [small, large])
    small_copy, large_copy = small.clone(), large.clone()
    small.zero_(), large.zero_()
    a, b = cache.get_embeddings(keys)
    assert a is not None and b is not None
    assert torch.equal(a, small_copy) and torch.equal(b, large_copy)
    a.zero_(), b.zero_()
    again = cache.get_embeddings(keys)
    assert again[0] is not None and torch.equal(again[0], small_copy)
    assert again[1] is not None and torch.equal(again[1], large_copy)


def test_duplicate_keys_in_one_batch_read_the_right_data(cache: MooncakeCache) -> None:
    tensors = [torch.full((32, 32), float(i)) for i in range(3)]
    keys = [key(4000 + i) for i in range(3)]
    cache.insert_batch(keys, tensors)
    order = [0, 0, 1, 0, 2, 2, 1]
    got = cache.get_embeddings([keys[i] for i in order])
    for g, i in zip(got, order, strict=True):
        assert g is not None and torch.equal(g, tensors[i])


def test_insert_overwrites_and_last_duplicate_wins(cache: MooncakeCache) -> None:
    k = key(5000)
    cache.insert_batch([k], [torch.zeros(4)])
    assert cache.insert_batch([k], [torch.ones(4)]) == [True]
    got = cache.get_embeddings([k])[0]
    assert got is not None and torch.equal(got, torch.ones(4))
    assert cache.insert_batch([k, k], [torch.full((4,), 2.0), torch.full((4,), 3.0)]) == [True, True]
    got = cache.get_embeddings([k])[0]
    assert got is not None and torch.equal(got, torch.full((4,), 3.0))


def test_missing_keys_are_misses_and_counted(cache: MooncakeCache) -> None:
    before = cache.stats()
    k = key(6000)
    assert cache.batch_is_exist([k]) == [False]
    assert cache.get_embeddings([k, k]) == [None, None]
    cache.insert_batch([k], [torch.ones(2)])
    assert cache.batch_is_exist([k, key(6001)]) == [True, False]
    assert cache.prefetch([k, key(6001)]) == 1
    after = cache.stats()
    assert after.misses - before.misses == 2
    assert after.inserts - before.inserts == 1
    assert cache.get_embeddings([]) == [] and cache.batch_is_exist([]) == []


def test_corrupt_truncated_and_misplaced_entries_are_never_served(
    cache: MooncakeCache, mooncake_master_session: MasterProcess
) -> None:
    with raw_client(local_config(mooncake_master_session, local_buffer_size=64 * MiB)) as store:
        good = encode_entry(key(7000).to_key(), torch.randn(64, 64))
        flipped = bytearray(good)
        flipped[len(flipped) // 2] ^= 0x10
        cases = {
            key(7001): b"not an entry at all",
            key(7002): good[:-1],
            key(7003): good + b"\x00",
            key(7004): bytes(flipped),
            key(7005): good,  # written under 7000's key: misplaced
            key(7006): encode_entry(key(7006).to_key(), torch.randn(300, 300))[:-5],
        }
        for k, raw in cases.items():
            assert store.upsert(k.to_key(), raw) == 0
        before = cache.stats()
        assert cache.get_embeddings(list(cases)) == [None] * len(cases)
        assert cache.stats().corrupt - before.corrupt == len(cases)


def test_a_second_process_reads_what_the_first_wrote(
    cache: MooncakeCache, mooncake_master_session: MasterProcess
) -> None:
    tensors = [torch.randn(128, 256).bfloat16(), torch.randn(512, 1024)]
    keys = [key(8000), key(8001)]
    assert cache.insert_batch(keys, tensors) == [True, True]
    script = f"""
import sys, torch
from mmkey import EmbeddingKey, MooncakeCache, MooncakeConfig
cache = MooncakeCache(MooncakeConfig(master_server_address={mooncake_master_session.address!r},
                                     global_segment_size=0, timeout={ROOMY_TIMEOUT}, setup_timeout=60.0))
got = cache.get_embeddings([EmbeddingKey.from_key(k) for k in sys.argv[1:]])
for t in got:
    print("miss" if t is None else f"{{t.dtype}} {{tuple(t.shape)}} {{t.float().sum().item():.6e}}")
cache.close()
"""
    out = subprocess.run(
        [sys.executable, "-c", script, *(k.to_key() for k in keys)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    expected = [f"{t.dtype} {tuple(t.shape)} {t.float().sum().item():.6e}" for t in tensors]
    assert out.stdout.split("\n")[:2] == expected


def test_wrong_types_and_lengths_are_refused(cache: MooncakeCache) -> None:
    with pytest.raises(TypeError, match="from_key"):
        cache.get_embeddings([key(1).to_key()])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="bare digest"):
        cache.batch_is_exist([mm_hash(5)])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        cache.get_embeddings(key(1).to_key())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one embedding per key"):
        cache.insert_batch([key(1), key(2)], [torch.ones(1)])
    with pytest.raises(TypeError, match="MooncakeConfig"):
        MooncakeCache("127.0.0.1:50051")  # type: ignore[arg-type]


def test_calls_after_close_raise_store_closed(mooncake_master_session: MasterProcess) -> None:
    c = MooncakeCache(config(mooncake_master_session))
    c.insert_batch([key(9000)], [torch.ones(3)])
    c.close()
    c.close()  # idempotent
    for call in (
        lambda: c.get_embeddings([key(9000)]),
        lambda: c.batch_is_exist([key(9000)]),
        lambda: c.insert_batch([key(9000)], [torch.ones(3)]),
        lambda: c.prefetch([key(9000)]),
        c.stats,
    ):
        with pytest.raises(StoreClosed):
            call()
    assert "closed" in repr(c)


def test_a_missing_binding_is_a_store_error_naming_the_install(
    monkeypatch: pytest.MonkeyPatch, mooncake_master_session: MasterProcess
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(StoreError, match="mooncake-cpu"):
        MooncakeCache(config(mooncake_master_session))


# -- faults: a master of the test's own --------------------------------------------------


def test_killed_and_restarted_master(mooncake_master: MasterProcess) -> None:
    c = MooncakeCache(config(mooncake_master, timeout=TIMEOUT))
    try:
        k = key(10_000)
        c.insert_batch([k], [torch.ones(8)])
        mooncake_master.kill()
        # the give-up time of each call is the fake-clock tests' (test_mooncake_clock.py) and
        # the hung master's below, in real time; here, what a dead master's calls answer
        for _ in range(5):
            assert c.get_embeddings([k]) == [None]
            assert c.insert_batch([k], [torch.ones(8)]) == [False]
            assert c.batch_is_exist([k]) == [False]
        assert c.stats().errors > 0 and not c.is_connected()
        mooncake_master.restart()
        # a restarted master has lost its keys: a cold cache, then writes work again
        assert wait_until(lambda: c.insert_batch([k], [torch.full((8,), 2.0)]) == [True], 30)
        got_after = c.get_embeddings([k])[0]
        assert got_after is not None and torch.equal(got_after, torch.full((8,), 2.0))
        assert c.is_connected()
    finally:
        c.close()


@pytest.mark.realtime
def test_hung_master_answers_misses_within_the_timeout_and_recovers(
    mooncake_master: MasterProcess,
) -> None:
    c = MooncakeCache(config(mooncake_master, timeout=TIMEOUT))
    try:
        k = key(11_000)
        c.insert_batch([k], [torch.ones(8)])
        mooncake_master.pause()
        for _ in range(6):
            got, took = timed(lambda: c.get_embeddings([k]))
            assert got == [None] and took < BOUND
            ok, took = timed(lambda: c.insert_batch([key(11_001)], [torch.ones(8)]))
            assert ok == [False] and took < BOUND
        mooncake_master.resume()

        def served() -> bool:
            got = c.get_embeddings([k])[0]
            return got is not None and torch.equal(got, torch.ones(8))

        assert wait_until(served, 60)
    finally:
        c.close()


@pytest.mark.realtime
def test_no_master_at_construction_then_it_comes_up(mooncake_master: MasterProcess) -> None:
    mooncake_master.kill()
    c, took = timed(lambda: MooncakeCache(config(mooncake_master, timeout=TIMEOUT)))
    assert isinstance(c, MooncakeCache)
    try:
        assert took < 5.0 + BOUND  # the setup timeout, never Mooncake's ~90 s retry loop
        assert not c.is_connected()
        assert c.get_embeddings([key(12_000)]) == [None]
        mooncake_master.restart()
        assert wait_until(lambda: c.insert_batch([key(12_000)], [torch.ones(2)]) == [True], 30)
        assert c.is_connected()
    finally:
        c.close()


def test_concurrent_callers_queue_instead_of_missing(cache: MooncakeCache) -> None:
    # healthy store, four threads: every read of a held key is a hit, no error counted
    keys = [key(16_000 + i) for i in range(32)]
    values = [torch.full((16 * 1024,), float(i)) for i in range(32)]
    assert cache.insert_batch(keys, values) == [True] * 32
    before = cache.stats()
    wrong: list[int] = []

    def reader() -> None:
        for _ in range(20):
            for got, want in zip(cache.get_embeddings(keys), values, strict=True):
                if got is None or not torch.equal(got, want):
                    wrong.append(1)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert cache.stats().errors == before.errors


def test_close_with_a_hung_master_returns_within_the_setup_timeout(
    mooncake_master: MasterProcess,
) -> None:
    c = MooncakeCache(config(mooncake_master, setup_timeout=1.0, timeout=TIMEOUT))
    c.insert_batch([key(13_000)], [torch.ones(2)])
    mooncake_master.pause()
    c.get_embeddings([key(13_000)])  # leaves a call stuck on the worker
    _, took = timed(c.close)
    assert took < 1.0 + BOUND
    with pytest.raises(StoreClosed):
        c.get_embeddings([key(13_000)])
    mooncake_master.resume()
    from mmkey.cache.mooncake._transport import _ABANDONED, close_abandoned

    # before the master stops (stores an earlier test of this process abandoned may go too)
    assert c._transport.join(40) and close_abandoned() >= 1
    assert all(transport is not c._transport for transport, _ in _ABANDONED)


def test_entries_larger_than_the_staging_buffer_and_its_slots(
    mooncake_master_session: MasterProcess,
) -> None:
    # a 4 MiB staging buffer: 8 MiB entries bypass it on write, and in a batch read of
    # many keys each slot is smaller than the large entries, which are then read alone; a
    # generous timeout: this test is about sizes (16 MiB missed 0.3 s on a crowded host)
    cfg = config(mooncake_master_session, local_buffer_size=4 * MiB)
    with MooncakeCache(cfg) as c:
        big = [torch.randn(2 * MiB) for _ in range(2)]  # 8 MiB each
        small = [torch.randn(64, 64) for _ in range(30)]
        keys = [key(14_000 + i) for i in range(32)]
        assert c.insert_batch(keys, big + small) == [True] * 32
        got = c.get_embeddings(keys)
        for g, want in zip(got, big + small, strict=True):
            assert g is not None and torch.equal(g, want)
        assert c.stats().errors == 0


def test_an_unclosed_cache_warns_when_collected(mooncake_master_session: MasterProcess) -> None:
    c = MooncakeCache(config(mooncake_master_session))
    with pytest.warns(ResourceWarning, match="never closed"):
        c.__del__()
    c.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.__del__()  # closed: silent
