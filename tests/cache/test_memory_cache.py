"""MemoryCache: exact byte budget, LRU order, verified reads, isolation, threads, close."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from mmkey import (
    CacheStats,
    EmbeddingCache,
    EmbeddingKey,
    HashScheme,
    MemoryCache,
    Modality,
    StoreClosed,
    mm_hash,
)
from mmkey.entry.codec import entry_size


def key(i: int, namespace: str = "vit") -> EmbeddingKey:
    return EmbeddingKey(namespace, Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


def emb(i: int, numel: int = 64) -> torch.Tensor:
    return torch.full((numel,), float(i))


SIZE = entry_size(key(0).to_key(), emb(0))
"""Bytes of one test entry; all test keys have the same length."""


def test_is_an_embedding_cache_and_checks_its_budget_argument() -> None:
    assert isinstance(MemoryCache(1), EmbeddingCache)
    assert MemoryCache(123).max_bytes == 123
    for bad in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            MemoryCache(bad)
    for wrong in (True, 1.5, "1024"):
        with pytest.raises(TypeError, match="int"):
            MemoryCache(wrong)  # type: ignore[arg-type]


def test_round_trip_miss_and_existence() -> None:
    cache = MemoryCache(1 << 20)
    assert cache.insert_batch([key(1), key(2)], [emb(1), emb(2, 3)]) == [True, True]
    got = cache.get_embeddings([key(2), key(3), key(1)])
    assert got[1] is None
    assert got[0] is not None and got[0].tolist() == [2.0, 2.0, 2.0]
    assert got[2] is not None and torch.equal(got[2], emb(1))
    assert cache.batch_is_exist([key(1), key(3), key(2)]) == [True, False, True]
    assert cache.prefetch([key(1), key(3), key(2), key(1)]) == 3
    assert cache.get_embeddings([]) == [] and cache.insert_batch([], []) == []


def test_namespace_modality_and_scheme_separate_entries() -> None:
    cache = MemoryCache(1 << 20)
    variants = [
        key(1),
        key(1, "other-model"),
        EmbeddingKey("vit", Modality.VIDEO, HashScheme.BLAKE3, mm_hash(1)),
        EmbeddingKey("vit", Modality.IMAGE, HashScheme.XXH3, mm_hash(1)),
    ]
    cache.insert_batch(variants, [emb(i) for i in range(4)])
    got = cache.get_embeddings(variants)
    assert [t.tolist()[0] if t is not None else None for t in got] == [0.0, 1.0, 2.0, 3.0]


def test_budget_is_exact_and_lru_evicts_the_least_recent() -> None:
    cache = MemoryCache(3 * SIZE)
    cache.insert_batch([key(1), key(2), key(3)], [emb(1), emb(2), emb(3)])
    assert cache.stats().bytes_held == 3 * SIZE
    cache.get_embeddings([key(1)])  # 1 becomes the most recent: 2 is next out
    cache.insert_batch([key(4)], [emb(4)])
    assert cache.batch_is_exist([key(1), key(2), key(3), key(4)]) == [True, False, True, True]
    cache.prefetch([key(3)])  # prefetch also refreshes: 1 is next out
    cache.insert_batch([key(5)], [emb(5)])
    assert cache.batch_is_exist([key(1), key(3), key(4), key(5)]) == [False, True, True, True]
    stats = cache.stats()
    assert (stats.bytes_held, stats.entries, stats.evictions) == (3 * SIZE, 3, 2)


def test_existence_checks_do_not_change_recency() -> None:
    cache = MemoryCache(2 * SIZE)
    cache.insert_batch([key(1), key(2)], [emb(1), emb(2)])
    assert cache.batch_is_exist([key(1)]) == [True]
    cache.insert_batch([key(3)], [emb(3)])
    assert cache.batch_is_exist([key(1), key(2), key(3)]) == [False, True, True]


def test_an_entry_over_budget_is_refused_and_leaves_nothing_stale() -> None:
    cache = MemoryCache(SIZE)
    assert cache.insert_batch([key(1)], [emb(1)]) == [True]
    assert cache.insert_batch([key(1)], [emb(9, numel=65)]) == [False]
    assert cache.get_embeddings([key(1)]) == [None]
    assert cache.stats().bytes_held == 0
    assert cache.insert_batch([key(2)], [emb(2)]) == [True]


def test_duplicate_keys_in_a_batch_last_write_wins() -> None:
    cache = MemoryCache(1 << 20)
    assert cache.insert_batch([key(1), key(1)], [emb(1), emb(7)]) == [True, True]
    got = cache.get_embeddings([key(1)])[0]
    assert got is not None and got[0].item() == 7.0
    assert cache.stats().entries == 1 and cache.stats().bytes_held == SIZE


def test_a_batch_over_budget_reports_what_stayed() -> None:
    cache = MemoryCache(2 * SIZE)
    held = cache.insert_batch([key(i) for i in range(4)], [emb(i) for i in range(4)])
    assert held == [False, False, True, True]
    assert cache.stats().inserts == 4 and cache.stats().evictions == 2


def test_mutating_tensors_after_insert_or_get_cannot_change_the_cache() -> None:
    cache = MemoryCache(1 << 20)
    original = torch.arange(32, dtype=torch.bfloat16)
    mine = original.clone()
    cache.insert_batch([key(1)], [mine])
    mine.fill_(-1)
    first = cache.get_embeddings([key(1)])[0]
    assert first is not None
    first.fill_(5)
    again = cache.get_embeddings([key(1)])[0]
    assert again is not None and torch.equal(again, original)
    assert again.data_ptr() != first.data_ptr()


def test_a_corrupt_entry_is_a_counted_miss_and_is_dropped() -> None:
    cache = MemoryCache(1 << 20)
    cache.insert_batch([key(1), key(2)], [emb(1), emb(2)])
    entries = cache._entries  # fault injection: flip one payload bit in place
    broken = bytearray(entries[key(1).to_key()])
    broken[-1] ^= 0x10
    entries[key(1).to_key()] = bytes(broken)
    got = cache.get_embeddings([key(1), key(2)])
    assert got[0] is None and got[1] is not None
    stats = cache.stats()
    assert (stats.corrupt, stats.hits, stats.misses, stats.entries) == (1, 1, 1, 1)
    assert stats.bytes_held == SIZE
    assert cache.batch_is_exist([key(1)]) == [False]


def test_entries_copied_under_another_key_never_read() -> None:
    cache = MemoryCache(1 << 20)
    cache.insert_batch([key(1)], [emb(1)])
    cache._entries[key(2).to_key()] = cache._entries[key(1).to_key()]
    cache._held += SIZE
    assert cache.get_embeddings([key(2)]) == [None]
    assert cache.stats().corrupt == 1


def test_stats_count_every_operation() -> None:
    cache = MemoryCache(2 * SIZE)
    assert cache.stats() == CacheStats(bytes_held=0, entries=0)
    cache.insert_batch([key(1), key(2), key(3)], [emb(1), emb(2), emb(3)])
    cache.get_embeddings([key(1), key(2), key(3), key(3)])  # key 1 was evicted
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.inserts, stats.evictions) == (3, 1, 3, 1)
    assert (stats.corrupt, stats.errors, stats.entries) == (0, 0, 2)
    assert stats.hit_rate == 0.75


def test_close_refuses_every_later_call() -> None:
    cache = MemoryCache(1 << 20)
    cache.insert_batch([key(1)], [emb(1)])
    cache.close()
    cache.close()
    calls = [
        lambda: cache.get_embeddings([key(1)]),
        lambda: cache.batch_is_exist([key(1)]),
        lambda: cache.insert_batch([key(1)], [emb(1)]),
        lambda: cache.prefetch([key(1)]),
        cache.stats,
    ]
    for call in calls:
        with pytest.raises(StoreClosed):
            call()
    assert "closed=True" in repr(cache)


def test_threads_never_read_a_wrong_tensor_or_exceed_the_budget() -> None:
    budget = 12 * SIZE
    cache = MemoryCache(budget)
    keys = [key(i) for i in range(40)]
    stop = threading.Event()
    failures: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(1000):
            picks = rng.sample(range(len(keys)), rng.randint(1, 6))
            if rng.random() < 0.5:
                cache.insert_batch([keys[i] for i in picks], [emb(i) for i in picks])
            else:
                for i, got in zip(picks, cache.get_embeddings([keys[i] for i in picks]), strict=True):
                    if got is not None and not torch.equal(got, emb(i)):
                        failures.append(f"key {i} read {got[:3].tolist()}")
                    if got is not None:
                        got.fill_(-1.0)  # the reader scribbles on what it got

    def watch() -> None:
        while not stop.is_set():
            held = cache.stats().bytes_held
            if held is None or held > budget:
                failures.append(f"{held} bytes held over budget {budget}")

    watcher = threading.Thread(target=watch)
    workers = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    watcher.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    watcher.join()
    assert failures == []
    stats = cache.stats()
    assert stats.bytes_held == sum(len(e) for e in cache._entries.values()) <= budget
    assert stats.corrupt == 0 and stats.hits > 0 and stats.evictions > 0
