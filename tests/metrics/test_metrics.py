"""mmkey.metrics: MeteredCache times any EmbeddingCache and exports its stats and health."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

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
    TieredCache,
    mm_hash,
)
from mmkey.cache.health import CacheHealth, ReportsHealth, health_of
from mmkey.entry.codec import entry_size
from mmkey.metrics import COUNTERS, MeteredCache


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("vit", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


def emb(i: int) -> torch.Tensor:
    return torch.full((8,), float(i))


SIZE = entry_size(key(0).to_key(), emb(0))


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


class FixedCache(MemoryCache):
    """A real MemoryCache whose stats and health are set by the test (distinct values catch a
    counter exported under the wrong name)."""

    def __init__(self, stats: CacheStats, health: CacheHealth | None) -> None:
        super().__init__(1 << 20)
        self.fixed_stats = stats
        self.fixed_health = health

    def stats(self) -> CacheStats:
        return self.fixed_stats

    def health(self) -> CacheHealth:
        if self.fixed_health is None:
            raise StoreClosed("no health")
        return self.fixed_health


def test_a_metered_cache_is_the_cache_it_wraps_plus_timing() -> None:
    registry = CollectorRegistry()
    inner = MemoryCache(2 * SIZE)
    cache = MeteredCache(inner, name="l1", registry=registry)
    as_protocol: EmbeddingCache = cache
    assert isinstance(as_protocol, EmbeddingCache)
    assert cache.cache is inner and cache.name == "l1"
    # the budget holds two entries: the first of the batch is evicted by the third
    assert cache.insert_batch([key(1), key(2), key(3)], [emb(1), emb(2), emb(3)]) == [False, True, True]
    got = cache.get_embeddings([key(3), key(1), key(9)])
    assert got[0] is not None and torch.equal(got[0], emb(3))
    assert got[1] is None and got[2] is None  # key(1) was evicted by the budget
    assert cache.batch_is_exist([key(2), key(3)]) == [True, True]
    assert cache.prefetch([key(3)]) == 1
    assert cache.stats() == inner.stats()

    stats = inner.stats()
    assert (stats.hits, stats.misses, stats.inserts, stats.evictions) == (1, 2, 3, 1)
    for field in COUNTERS:
        assert sample(registry, f"mmkey_cache_{field}_total", cache="l1") == getattr(stats, field), field
    assert sample(registry, "mmkey_cache_bytes_held", cache="l1") == 2 * SIZE
    assert sample(registry, "mmkey_cache_entries", cache="l1") == 2
    for operation, calls, keys in (
        ("insert_batch", 1, 3),
        ("get_embeddings", 1, 3),
        ("batch_is_exist", 1, 2),
        ("prefetch", 1, 1),
    ):
        labels = {"cache": "l1", "operation": operation}
        assert sample(registry, "mmkey_cache_call_seconds_count", **labels) == calls
        assert sample(registry, "mmkey_cache_call_seconds_bucket", le="+Inf", **labels) == calls
        seconds = sample(registry, "mmkey_cache_call_seconds_sum", **labels)
        assert seconds is not None and seconds > 0
        assert sample(registry, "mmkey_cache_call_keys_total", **labels) == keys
    # a MemoryCache has no store: no breaker or quarantine series
    assert sample(registry, "mmkey_cache_breaker_open", cache="l1") is None
    cache.close()
    with pytest.raises(StoreClosed):
        inner.get_embeddings([key(3)])


def test_every_counter_is_exported_under_its_own_name() -> None:
    registry = CollectorRegistry()
    values = {field: 10 + i for i, field in enumerate(COUNTERS)}
    stats = CacheStats(**values, bytes_held=None, entries=None)
    cache = MeteredCache(FixedCache(stats, None), name="remote", registry=registry)
    for field, value in values.items():
        assert sample(registry, f"mmkey_cache_{field}_total", cache="remote") == value
    # what a remote store's client cannot know is absent, not 0
    assert sample(registry, "mmkey_cache_bytes_held", cache="remote") is None
    assert sample(registry, "mmkey_cache_entries", cache="remote") is None
    assert set(COUNTERS) == {f.name for f in attrs.fields(CacheStats)} - {"bytes_held", "entries"}
    cache.close()


def test_breaker_and_quarantined_holders_of_a_cache_that_reports_health() -> None:
    registry = CollectorRegistry()
    health = CacheHealth(
        breaker_open=True, quarantined=("127.0.0.1:15002", "127.0.0.1:15001"), busy_lanes=2, writes_held=True
    )
    remote = FixedCache(CacheStats(), health)
    assert isinstance(remote, ReportsHealth)
    assert health_of(remote) == health
    assert health.quarantined == ("127.0.0.1:15001", "127.0.0.1:15002")  # sorted
    cache = MeteredCache(remote, name="mooncake", registry=registry)
    assert sample(registry, "mmkey_cache_breaker_open", cache="mooncake") == 1
    assert sample(registry, "mmkey_cache_quarantined_holders", cache="mooncake") == 2
    assert sample(registry, "mmkey_cache_busy_lanes", cache="mooncake") == 2
    assert sample(registry, "mmkey_cache_writes_held", cache="mooncake") == 1
    for endpoint in health.quarantined:
        assert sample(registry, "mmkey_cache_holder_quarantined", cache="mooncake", holder=endpoint) == 1
    remote.fixed_health = CacheHealth()  # the holders answered again
    assert sample(registry, "mmkey_cache_breaker_open", cache="mooncake") == 0
    assert sample(registry, "mmkey_cache_quarantined_holders", cache="mooncake") == 0
    assert sample(registry, "mmkey_cache_writes_held", cache="mooncake") == 0
    assert (
        sample(registry, "mmkey_cache_holder_quarantined", cache="mooncake", holder="127.0.0.1:15001") is None
    )
    remote.fixed_health = None  # a failing hook: no health series, the scrape still works
    assert sample(registry, "mmkey_cache_breaker_open", cache="mooncake") is None
    assert sample(registry, "mmkey_cache_hits_total", cache="mooncake") == 0
    cache.close()


def test_a_tiered_cache_merges_its_tiers_health() -> None:
    registry = CollectorRegistry()
    far = FixedCache(CacheStats(), CacheHealth(quarantined=("10.0.0.2:1",), busy_lanes=1))
    tiered = TieredCache(MemoryCache(1 << 20), far)
    assert tiered.health() == CacheHealth(quarantined=("10.0.0.2:1",), busy_lanes=1)
    assert TieredCache(MemoryCache(1), MemoryCache(1)).health() == CacheHealth()
    merged = CacheHealth(breaker_open=True, quarantined=("a:1",)).merged(
        CacheHealth(quarantined=("b:2", "a:1"), writes_held=True)
    )
    assert merged == CacheHealth(breaker_open=True, quarantined=("a:1", "b:2"), writes_held=True)
    cache = MeteredCache(tiered, name="tiered", registry=registry)
    assert sample(registry, "mmkey_cache_holder_quarantined", cache="tiered", holder="10.0.0.2:1") == 1
    assert sample(registry, "mmkey_cache_breaker_open", cache="tiered") == 0
    cache.close()


def test_names_are_unique_per_registry_and_freed_on_close() -> None:
    registry = CollectorRegistry()
    first = MeteredCache(MemoryCache(1 << 20), name="a", registry=registry)
    first.get_embeddings([key(1)])
    with pytest.raises(ValueError, match="already registered"):
        MeteredCache(MemoryCache(1 << 20), name="a", registry=registry)
    other = MeteredCache(MemoryCache(1 << 20), name="a", registry=CollectorRegistry())
    first.close()
    first.close()  # idempotent
    assert sample(registry, "mmkey_cache_hits_total", cache="a") is None
    labels = {"cache": "a", "operation": "get_embeddings"}
    assert sample(registry, "mmkey_cache_call_seconds_count", **labels) is None
    again = MeteredCache(MemoryCache(1 << 20), name="a", registry=registry)
    assert sample(registry, "mmkey_cache_call_seconds_count", **labels) == 0
    assert sample(registry, "mmkey_cache_misses_total", cache="a") == 0
    with pytest.raises(ValueError, match="buckets"):
        MeteredCache(MemoryCache(1), name="b", registry=registry, buckets=(0.1, 1.0))
    text = generate_latest(registry).decode()
    assert 'mmkey_cache_misses_total{cache="a"} 0.0' in text
    again.close()
    other.close()


def test_misuse_is_refused_with_the_fix_named() -> None:
    registry = CollectorRegistry()
    memory = MemoryCache(1 << 20)
    with pytest.raises(TypeError, match="synchronous"):
        MeteredCache(AsyncCache(memory), registry=registry)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EmbeddingCache"):
        MeteredCache(object(), registry=registry)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name"):
        MeteredCache(memory, name="", registry=registry)
    with pytest.raises(TypeError, match="CollectorRegistry"):
        MeteredCache(memory, registry=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CacheHealth.quarantined"):
        CacheHealth(quarantined="127.0.0.1:1")  # one endpoint, not a tuple of them
    cache = MeteredCache(memory, name="m", registry=registry)
    with pytest.raises(TypeError):
        cache.get_embeddings([1])  # type: ignore[list-item]
    # a refused call is not timed: it never reached the cache's work
    assert sample(registry, "mmkey_cache_call_seconds_count", cache="m", operation="get_embeddings") == 0
    cache.close()


def test_the_async_adapter_over_a_metered_cache_times_each_call() -> None:
    import asyncio

    registry = CollectorRegistry()
    cache = AsyncCache(MeteredCache(MemoryCache(1 << 20), name="async", registry=registry))

    async def scenario(keys: Sequence[CacheKey]) -> None:
        await cache.insert_batch(keys, [emb(i) for i in range(len(keys))])
        assert await cache.get_embeddings(keys) != [None, None]

    asyncio.run(scenario([key(1), key(2)]))
    for operation in ("insert_batch", "get_embeddings"):
        assert sample(registry, "mmkey_cache_call_seconds_count", cache="async", operation=operation) == 1
    assert sample(registry, "mmkey_cache_hits_total", cache="async") == 2
    asyncio.run(cache.close())
    assert sample(registry, "mmkey_cache_hits_total", cache="async") is None
