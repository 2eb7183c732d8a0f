"""TieredCache: read-through with promotion, write-through, prefetch, faults, composition."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import attrs
import pytest
import torch

from mmkey import (
    AsyncCache,
    CacheKey,
    CacheStats,
    EmbeddingCache,
    EmbeddingKey,
    HashScheme,
    MemoryCache,
    Modality,
    StoreClosed,
    StoreError,
    TieredCache,
    mm_hash,
)
from mmkey.entry.codec import entry_size


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("vit", Modality.AUDIO, HashScheme.XXH3, mm_hash(i))


def emb(i: int) -> torch.Tensor:
    return torch.full((16,), float(i))


SIZE = entry_size(key(0).to_key(), emb(0))


class BrokenStore:
    """A tier whose store is down: every call raises `StoreError`."""

    def __init__(self) -> None:
        self.closed = False

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        raise StoreError("master unreachable")

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        raise StoreError("master unreachable")

    def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        raise StoreError("master unreachable")

    def prefetch(self, keys: Sequence[CacheKey]) -> int:
        raise StoreError("master unreachable")

    def stats(self) -> CacheStats:
        raise StoreError("master unreachable")

    def close(self) -> None:
        self.closed = True


def values(got: list[torch.Tensor | None]) -> list[float | None]:
    return [None if t is None else t[0].item() for t in got]


def test_is_an_embedding_cache_and_needs_two_distinct_caches() -> None:
    l1 = MemoryCache(1 << 20)
    assert isinstance(TieredCache(l1, MemoryCache(1 << 20)), EmbeddingCache)
    with pytest.raises(ValueError, match="different"):
        TieredCache(l1, l1)
    with pytest.raises(TypeError, match="EmbeddingCache"):
        TieredCache(l1, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"synchronous EmbeddingCache, got the async AsyncCache"):
        TieredCache(l1, AsyncCache(MemoryCache(1)))  # type: ignore[arg-type]


def test_reads_fall_through_to_l2_and_promote_hits() -> None:
    l1, l2 = MemoryCache(1 << 20), MemoryCache(1 << 20)
    l2.insert_batch([key(1), key(2)], [emb(1), emb(2)])
    l1.insert_batch([key(3)], [emb(3)])
    cache = TieredCache(l1, l2)
    assert values(cache.get_embeddings([key(1), key(3), key(4)])) == [1.0, 3.0, None]
    assert l1.batch_is_exist([key(1), key(2)]) == [True, False]
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (2, 1)


def test_a_promoted_tensor_is_independent_of_the_copy_in_l1() -> None:
    l1, l2 = MemoryCache(1 << 20), MemoryCache(1 << 20)
    l2.insert_batch([key(1)], [emb(1)])
    cache = TieredCache(l1, l2)
    got = cache.get_embeddings([key(1)])[0]
    assert got is not None
    got.fill_(-1)
    assert values(l1.get_embeddings([key(1)])) == [1.0]
    assert values(cache.get_embeddings([key(1)])) == [1.0]


def test_writes_go_through_to_both_tiers() -> None:
    l1, l2 = MemoryCache(1 << 20), MemoryCache(1 << 20)
    cache = TieredCache(l1, l2)
    assert cache.insert_batch([key(1), key(2)], [emb(1), emb(2)]) == [True, True]
    assert l1.batch_is_exist([key(1), key(2)]) == [True, True]
    assert l2.batch_is_exist([key(1), key(2)]) == [True, True]
    assert cache.stats().inserts == 2


def test_an_entry_too_big_for_l1_is_still_held_by_l2() -> None:
    l1, l2 = MemoryCache(SIZE - 1), MemoryCache(1 << 20)
    cache = TieredCache(l1, l2)
    assert cache.insert_batch([key(1)], [emb(1)]) == [True]
    assert l1.batch_is_exist([key(1)]) == [False]
    assert cache.batch_is_exist([key(1), key(2)]) == [True, False]
    assert values(cache.get_embeddings([key(1)])) == [1.0]


def test_prefetch_warms_l1_from_l2() -> None:
    l1, l2 = MemoryCache(1 << 20), MemoryCache(1 << 20)
    l2.insert_batch([key(1), key(2)], [emb(1), emb(2)])
    l1.insert_batch([key(3)], [emb(3)])
    cache = TieredCache(l1, l2)
    assert cache.prefetch([key(1), key(2), key(3), key(4)]) == 3
    assert l1.batch_is_exist([key(1), key(2), key(3), key(4)]) == [True, True, True, False]
    assert cache.prefetch([]) == 0
    assert l2.stats().hits == 2


def test_a_failing_tier_serves_misses_and_counts_errors() -> None:
    l1 = MemoryCache(1 << 20)
    cache = TieredCache(l1, BrokenStore())
    assert cache.insert_batch([key(1)], [emb(1)]) == [True]  # l1 still took it
    assert values(cache.get_embeddings([key(1), key(2)])) == [1.0, None]
    assert cache.batch_is_exist([key(1), key(2)]) == [True, False]
    assert cache.prefetch([key(1), key(2)]) == 1
    stats = cache.stats()
    assert stats.errors == 5  # insert, get, exist, prefetch's read, stats of l2
    assert (stats.hits, stats.misses) == (1, 1)
    assert (stats.bytes_held, stats.entries) == (None, None)  # the far tier could not say


def test_a_failing_near_tier_still_reads_the_far_one() -> None:
    l2 = MemoryCache(1 << 20)
    l2.insert_batch([key(1)], [emb(1)])
    cache = TieredCache(BrokenStore(), l2)
    assert values(cache.get_embeddings([key(1)])) == [1.0]
    assert cache.batch_is_exist([key(1)]) == [True]


class ShiftedAnswers(MemoryCache):
    """A tier that breaks the protocol: its answers leave out the first key's."""

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        return super().batch_is_exist(keys)[1:]

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        return super().get_embeddings(keys)[1:]

    def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        return super().insert_batch(keys, embeddings)[1:]


def test_an_answer_for_the_wrong_number_of_keys_is_a_tier_error_never_a_shifted_answer() -> None:
    l2 = ShiftedAnswers(1 << 20)
    MemoryCache.insert_batch(l2, [key(1), key(2)], [emb(1), emb(2)])
    cache = TieredCache(MemoryCache(1 << 20), l2)
    assert values(cache.get_embeddings([key(1), key(2)])) == [None, None]  # never emb(2) for key(1)
    assert cache.batch_is_exist([key(1), key(2)]) == [False, False]
    assert cache.insert_batch([key(3), key(4)], [emb(3), emb(4)]) == [True, True]  # l1 took them
    assert cache.stats().errors == 3
    near = TieredCache(ShiftedAnswers(1 << 20), MemoryCache(1 << 20))
    assert near.batch_is_exist([key(1), key(2)]) == [False, False]
    assert near.stats().errors == 1


def test_stats_sum_the_tiers_storage() -> None:
    l1, l2 = MemoryCache(SIZE), MemoryCache(1 << 20)
    cache = TieredCache(l1, l2)
    cache.insert_batch([key(1), key(2)], [emb(1), emb(2)])
    stats = cache.stats()
    assert (stats.bytes_held, stats.entries, stats.evictions) == (3 * SIZE, 3, 1)


class RemoteTier(MemoryCache):
    """A tier that, like a client of a remote store, cannot know what it holds."""

    def stats(self) -> CacheStats:
        return attrs.evolve(super().stats(), bytes_held=None, entries=None)


def test_stats_are_unknown_when_a_tier_does_not_know_its_own() -> None:
    cache = TieredCache(MemoryCache(1 << 20), RemoteTier(1 << 20))
    cache.insert_batch([key(1)], [emb(1)])
    stats = cache.stats()
    assert (stats.bytes_held, stats.entries, stats.inserts) == (None, None, 1)
    assert cache.l1.stats().entries == 1


def test_tiers_compose() -> None:
    l1, l2, l3 = MemoryCache(1 << 20), MemoryCache(1 << 20), MemoryCache(1 << 20)
    l3.insert_batch([key(1)], [emb(1)])
    cache = TieredCache(l1, TieredCache(l2, l3))
    assert values(cache.get_embeddings([key(1)])) == [1.0]
    assert l1.batch_is_exist([key(1)]) == [True] and l2.batch_is_exist([key(1)]) == [True]


def test_close_closes_both_tiers_once() -> None:
    l1, far = MemoryCache(1 << 20), BrokenStore()
    cache = TieredCache(l1, far)
    cache.close()
    cache.close()
    assert far.closed
    with pytest.raises(StoreClosed):
        l1.stats()
    for call in (
        lambda: cache.get_embeddings([key(1)]),
        lambda: cache.batch_is_exist([key(1)]),
        lambda: cache.insert_batch([key(1)], [emb(1)]),
        lambda: cache.prefetch([key(1)]),
        cache.stats,
    ):
        with pytest.raises(StoreClosed):
            call()


class HeldReads(MemoryCache):
    """A real far tier whose next `get_embeddings` reads, then waits for `release` to return."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.holding = False
        self.read_done = threading.Event()
        self.release = threading.Event()

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        found = super().get_embeddings(keys)
        if self.holding:
            self.holding = False
            self.read_done.set()
            assert self.release.wait(timeout=120)
        return found


def while_a_far_read_is_held(
    l2: HeldReads, read: Callable[[], object], meanwhile: Callable[[], None]
) -> object:
    """Run `read` in a thread; once its `l2` read has read (but not returned), run `meanwhile`."""
    got: list[object] = []
    l2.holding = True
    reader = threading.Thread(target=lambda: got.append(read()))
    reader.start()
    try:
        assert l2.read_done.wait(timeout=120)
        meanwhile()
    finally:
        l2.release.set()
        reader.join(timeout=120)
    assert not reader.is_alive() and len(got) == 1
    return got[0]


def test_a_promotion_never_overwrites_a_newer_insert() -> None:
    l1, l2 = MemoryCache(1 << 20), HeldReads()
    l2.insert_batch([key(1), key(2)], [emb(1), emb(2)])
    cache = TieredCache(l1, l2)

    def insert_v2() -> None:
        assert cache.insert_batch([key(1)], [emb(100)]) == [True]

    got = while_a_far_read_is_held(l2, lambda: cache.get_embeddings([key(1), key(2)]), insert_v2)
    assert isinstance(got, list) and values(got) == [1.0, 2.0]  # read before the insert: V1
    assert values(l1.get_embeddings([key(1), key(2)])) == [100.0, 2.0]  # key(2) promoted
    assert values(cache.get_embeddings([key(1)])) == [100.0]
    assert values(l2.get_embeddings([key(1)])) == [100.0]


def test_a_prefetch_never_overwrites_a_newer_insert() -> None:
    l1, l2 = MemoryCache(1 << 20), HeldReads()
    l2.insert_batch([key(1), key(2)], [emb(1), emb(2)])
    cache = TieredCache(l1, l2)

    def insert_v2() -> None:
        assert cache.insert_batch([key(1)], [emb(100)]) == [True]

    got = while_a_far_read_is_held(l2, lambda: cache.prefetch([key(1), key(2)]), insert_v2)
    assert got == 1  # key(2) promoted; key(1) left to the insert
    assert values(l1.get_embeddings([key(1), key(2)])) == [100.0, 2.0]


def test_a_write_of_another_key_during_the_far_read_does_not_stop_promotion() -> None:
    l1, l2 = MemoryCache(1 << 20), HeldReads()
    l2.insert_batch([key(1)], [emb(1)])
    cache = TieredCache(l1, l2)

    def insert_other() -> None:
        assert cache.insert_batch([key(2)], [emb(2)]) == [True]

    got = while_a_far_read_is_held(l2, lambda: cache.get_embeddings([key(1)]), insert_other)
    assert isinstance(got, list) and values(got) == [1.0]
    assert values(l1.get_embeddings([key(1), key(2)])) == [1.0, 2.0]


def test_reads_in_flight_leave_no_state_behind_even_when_a_tier_raises() -> None:
    class Exploding(MemoryCache):
        def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
            raise RuntimeError("not a store error")

    cache = TieredCache(MemoryCache(1 << 20), Exploding(1 << 20))
    with pytest.raises(RuntimeError):
        cache.get_embeddings([key(1)])
    l2 = MemoryCache(1 << 20)
    l2.insert_batch([key(2)], [emb(2)])
    ok = TieredCache(MemoryCache(1 << 20), l2)
    assert values(ok.get_embeddings([key(2), key(2), key(3)])) == [2.0, 2.0, None]
    assert cache._near_writes._reads == {} and ok._near_writes._reads == {}
