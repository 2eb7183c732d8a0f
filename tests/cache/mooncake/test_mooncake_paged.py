"""`MooncakeCache.register_memory`, `insert_from` and `read_into` against a real local master:
entries whose payload lies in several runs (pages of a pool), sent straight from registered
memory and read back, verified, into caller memory (a hung paged read and write, timed by a
fake clock on the fake store, are in test_mooncake_clock.py)."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mmkey import EmbeddingKey, EntryKeyring, HashScheme, Modality, MooncakeCache, StoreClosed, mm_hash
from mmkey.cache.mooncake import MooncakeConfig
from mmkey.entry.codec import encode_entry
from mmkey.testing.mooncake_master import MasterProcess
from tests._support import ROOMY_TIMEOUT, MiB, count_multi_buffer_puts, local_config, wait_until

pytestmark = pytest.mark.mooncake

TIMEOUT = 0.5
DIM = 64


def config(master: MasterProcess, **overrides: Any) -> MooncakeConfig:
    """Trusted-network mode (pools registered) and a roomy deadline, so that only a hang fails
    a test on a crowded host; the tests that kill or pause their master ask for `TIMEOUT`."""
    return local_config(master, **{"trusted_network": True, "timeout": ROOMY_TIMEOUT, **overrides})


def key(i: int, namespace: str = "paged-model") -> EmbeddingKey:
    return EmbeddingKey(namespace, Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


@pytest.fixture
def multi_buffer_puts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of keys of every ``batch_put_from_multi_buffers`` the binding receives."""
    return count_multi_buffer_puts(monkeypatch)


@pytest.fixture
def cache(mooncake_master_session: MasterProcess) -> Iterator[MooncakeCache]:
    c = MooncakeCache(config(mooncake_master_session, global_segment_size=256 * MiB))
    yield c
    c.close()


def pool(rows: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, DIM, generator=g).to(dtype)


def pages(tensor: torch.Tensor, *spans: tuple[int, int]) -> list[torch.Tensor]:
    return [tensor[start : start + length] for start, length in spans]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def test_pages_of_a_registered_pool_go_in_one_multi_buffer_put_and_read_back(
    mooncake_master_session: MasterProcess, multi_buffer_puts: list[int]
) -> None:
    src = pool(400)
    with MooncakeCache(config(mooncake_master_session)) as c:
        c.register_memory(src)
        runs = [pages(src, (0, 30), (100, 6)), pages(src, (200, 50)), pages(src, (300, 1), (360, 40))]
        keys = [key(i) for i in range(3)]
        assert c.insert_from(keys, runs) == [True, True, True]
        assert multi_buffer_puts == [3]  # straight from the pool: one put, no staging copy
        got = c.get_embeddings(keys)
        for tensor, want in zip(got, runs, strict=True):
            assert tensor is not None and same(tensor, torch.cat(want))
        dst = torch.zeros(400, DIM, dtype=torch.bfloat16)
        targets = [pages(dst, (10, 36)), pages(dst, (50, 20), (90, 30)), pages(dst, (200, 41))]
        assert c.read_into(keys, targets) == [True, True, True]
        for target, want in zip(targets, runs, strict=True):
            assert same(torch.cat(target), torch.cat(want))
        untouched = torch.ones(400, dtype=torch.bool)
        for start, length in ((10, 36), (50, 20), (90, 30), (200, 41)):
            untouched[start : start + length] = False
        assert not dst[untouched].any()  # nothing outside the targets was written
        assert c.stats().inserts == 3


def test_existing_keys_are_replaced_and_unregistered_memory_is_staged(
    mooncake_master_session: MasterProcess, multi_buffer_puts: list[int]
) -> None:
    registered, loose = pool(100, seed=1), pool(100, seed=2)
    with MooncakeCache(config(mooncake_master_session)) as c:
        c.register_memory(registered)
        k_new, k_loose = key(100), key(101)
        assert c.insert_from([k_loose], [pages(loose, (0, 10), (50, 10))]) == [True]
        assert multi_buffer_puts == []  # not registered: joined in staging
        assert c.insert_from([k_new], [pages(registered, (0, 20))]) == [True]
        assert multi_buffer_puts == [1]
        # the same key again, other data: a multi-buffer put would not replace it
        assert c.insert_from([k_new], [pages(registered, (40, 20))]) == [True]
        assert multi_buffer_puts == [1]
        got = c.get_embeddings([k_new, k_loose])
        assert got[0] is not None and same(got[0], registered[40:60])
        assert got[1] is not None and same(got[1], torch.cat([loose[0:10], loose[50:60]]))


def test_memory_registered_before_the_store_is_set_up_is_sent_from_once_it_is(
    mooncake_master: MasterProcess, multi_buffer_puts: list[int]
) -> None:
    src = pool(64)
    mooncake_master.pause()
    try:
        c = MooncakeCache(config(mooncake_master, timeout=TIMEOUT, setup_timeout=0.3))
        assert not c.is_connected()
        c.register_memory(src)  # no store yet: recorded
    finally:
        mooncake_master.resume()
    try:
        k = key(200)
        stored = [False]
        for _ in range(20):  # the breaker lets a call through after retry_after
            stored = c.insert_from([k], [[src[:32]]])
            if stored == [True]:
                break
            threading.Event().wait(0.25)
        assert stored == [True]
        assert multi_buffer_puts == [1]
        got = c.get_embeddings([k])[0]
        assert got is not None and same(got, src[:32])
    finally:
        c.close()


def test_registered_memory_still_goes_straight_to_a_restarted_master(
    mooncake_master: MasterProcess, multi_buffer_puts: list[int]
) -> None:
    src = pool(64, seed=8)
    c = MooncakeCache(config(mooncake_master, timeout=TIMEOUT))
    try:
        c.register_memory(src)
        assert c.insert_from([key(250)], [[src[:8]]]) == [True]
        assert multi_buffer_puts == [1]
        mooncake_master.kill()
        assert c.insert_from([key(251)], [[src[8:16]]]) == [False]
        mooncake_master.restart()  # a cold cache: the keys are gone, the registration is not
        assert wait_until(lambda: c.insert_from([key(251)], [[src[8:16]]]) == [True], 30)
        assert len(multi_buffer_puts) > 1 and multi_buffer_puts[-1] == 1  # straight, again
        dst = torch.zeros(8, DIM, dtype=torch.bfloat16)
        assert c.read_into([key(251)], [dst]) == [True] and same(dst, src[8:16])
    finally:
        c.close()


def test_read_into_writes_only_verified_entries_of_the_targets_shape(cache: MooncakeCache) -> None:
    src = pool(64, seed=3)
    keys = [key(300), key(301), key(302)]
    assert cache.insert_batch(keys[:2], [src[:16], src[16:48]]) == [True, True]
    dst = torch.zeros(64, DIM, dtype=torch.bfloat16)
    wrong_rows, wrong_dtype = dst[0:17], torch.zeros(32, DIM, dtype=torch.float32)
    assert cache.read_into(keys, [wrong_rows, [wrong_dtype], dst[20:36]]) == [False, False, False]
    assert not dst.any() and not wrong_dtype.any()
    stats = cache.stats()
    assert (stats.corrupt, stats.misses) == (2, 3)
    # the same key for two targets: both land
    assert cache.read_into([keys[0], keys[0]], [dst[0:16], [dst[30:40], dst[50:56]]]) == [True, True]
    assert same(dst[0:16], src[:16]) and same(torch.cat([dst[30:40], dst[50:56]]), src[:16])


def test_a_corrupted_entry_leaves_the_targets_untouched_and_is_logged(
    cache: MooncakeCache, caplog: pytest.LogCaptureFixture
) -> None:
    k = key(400)
    good = encode_entry(k.to_key(), pool(8, seed=4))
    bad = bytearray(good)
    bad[-1] ^= 0x01
    cache._transport.meta(lambda store: store.upsert(k.to_key(), bytes(bad)), cache._give_up())
    dst = torch.zeros(8, DIM, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="mmkey.cache.mooncake"):
        assert cache.read_into([k], [dst]) == [False]
    assert not dst.any()
    assert cache.stats().corrupt == 1
    assert "did not verify, served as misses: 1 corrupt" in caplog.text


def test_signed_entries_from_pages_verify_and_foreign_secrets_are_forged(
    mooncake_master_session: MasterProcess,
) -> None:
    ours, theirs = (
        EntryKeyring.from_secrets(hashlib.sha256(b"a").hexdigest()),
        EntryKeyring.from_secrets(hashlib.sha256(b"b").hexdigest()),
    )
    src = pool(50, seed=5)
    cfg = config(mooncake_master_session)
    with MooncakeCache(cfg, keyring=ours) as writer, MooncakeCache(cfg, keyring=theirs) as other:
        writer.register_memory(src)
        k = key(500, namespace="paged-signed")
        assert writer.insert_from([k], [pages(src, (0, 10), (20, 10))]) == [True]
        dst = torch.zeros(20, DIM, dtype=torch.bfloat16)
        assert other.read_into([k], [dst]) == [False]
        assert not dst.any() and other.stats().forged == 1
        assert writer.read_into([k], [dst]) == [True]
        assert same(dst, torch.cat([src[0:10], src[20:30]]))


def test_many_entries_pipeline_over_lanes_and_large_ones_get_their_own_buffer(
    mooncake_master_session: MasterProcess,
) -> None:
    # a 1 MiB staging buffer per lane: 40 entries of 256 KiB need many transfers, and a
    # 3 MiB entry does not fit a lane at all
    cfg = config(mooncake_master_session, global_segment_size=256 * MiB, local_buffer_size=1 * MiB)
    src = torch.randn(40 * 2048 + 24576, DIM).to(torch.bfloat16)  # 256 KiB per 2048 rows
    with MooncakeCache(cfg) as c:
        c.register_memory(src)
        runs = [[src[i * 2048 : (i + 1) * 2048]] for i in range(40)] + [[src[40 * 2048 :]]]
        keys = [key(600 + i, namespace="paged-many") for i in range(41)]
        assert c.insert_from(keys, runs) == [True] * 41
        dst = torch.zeros_like(src)
        targets = [[dst[i * 2048 : (i + 1) * 2048]] for i in range(40)] + [[dst[40 * 2048 :]]]
        assert c.read_into(keys, targets) == [True] * 41
        assert same(dst, src)


def test_bad_input_is_refused_before_anything_moves(cache: MooncakeCache) -> None:
    src = pool(16, seed=7)
    k = key(800)
    with pytest.raises(TypeError, match="list of targets"):
        cache.read_into([k], src)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1 keys and 2 targets"):
        cache.read_into([k], [src, src])
    with pytest.raises(ValueError, match="contiguous CPU"):
        cache.read_into([k], [src.T])
    with pytest.raises(TypeError, match="torch.Tensor"):
        cache.insert_from([k], [[b"bytes"]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="share one dtype"):
        cache.insert_from([k], [[src[:2], src[2:4].float()]])
    with pytest.raises(TypeError):
        cache.insert_from([k.to_key()], [src])  # type: ignore[list-item]
    assert cache.batch_is_exist([k]) == [False]
    with pytest.raises(TypeError, match="register_memory"):
        cache.register_memory(b"pool")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="contiguous CPU"):
        cache.register_memory(src.T)
    cache.register_memory(src)
    with pytest.raises(ValueError, match="overlaps"):
        cache.register_memory(src[4:8])


def test_closed_cache_refuses(cache: MooncakeCache) -> None:
    cache.close()
    with pytest.raises(StoreClosed):
        cache.read_into([key(900)], [pool(2)])
    with pytest.raises(StoreClosed):
        cache.insert_from([key(900)], [pool(2)])
    with pytest.raises(StoreClosed):
        cache.register_memory(pool(2))
