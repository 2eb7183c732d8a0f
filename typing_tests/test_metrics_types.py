"""mmkey.metrics and the honest stats: a metered cache is an EmbeddingCache; held counts may be unknown."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

from mmkey import AsyncCache, CacheStats, EmbeddingCache, EmbeddingKey, MemoryCache, TieredCache
from mmkey.cache.health import CacheHealth, ReportsHealth, health_of
from mmkey.metrics import MeteredCache


def a_metered_cache_is_an_embedding_cache(key: EmbeddingKey) -> None:
    metered = MeteredCache(MemoryCache(1 << 20), name="l1")
    as_cache: EmbeddingCache = metered
    nested: EmbeddingCache = TieredCache(metered, MeteredCache(MemoryCache(1 << 20), name="l2"))
    awaitable = AsyncCache(metered)
    assert_type(metered.get_embeddings([key]), list[torch.Tensor | None])
    assert_type(metered.stats(), CacheStats)
    assert_type(metered.cache, EmbeddingCache)
    assert_type(metered.health(), CacheHealth | None)
    del as_cache, nested, awaitable


def only_synchronous_caches_are_metered(cache: MemoryCache) -> None:
    MeteredCache(AsyncCache(cache))  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    MeteredCache(cache, name=None)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def megabytes(n: int) -> float:
    return n / 1e6


def held_counts_may_be_unknown(stats: CacheStats) -> None:
    assert_type(stats.entries, int | None)
    assert_type(stats.bytes_held, int | None)
    megabytes(stats.bytes_held)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    if stats.bytes_held is not None:
        assert_type(stats.bytes_held + 1, int)


def health_is_reported_by_tiered_caches(tiered: TieredCache, memory: MemoryCache) -> None:
    reporting: ReportsHealth = tiered
    assert_type(tiered.health(), CacheHealth)
    assert_type(health_of(memory), CacheHealth | None)
    not_reporting: ReportsHealth = memory  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
    del reporting, not_reporting
