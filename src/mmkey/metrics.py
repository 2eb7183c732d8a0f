"""Prometheus metrics for any `EmbeddingCache` (the optional extra ``mmkey[metrics]``).

`MeteredCache` wraps a cache, is itself an `EmbeddingCache`, and times every call into a
latency histogram per operation. At each scrape it also exports the wrapped cache's
`CacheStats` counters (hits, misses, inserts, evictions, corrupt, forged and its reasons,
errors, skipped, squatted, unsigned_served, oversized, and the single-flight counters
claims_won, waits_served, waits_timed_out and coalesced), what it holds where it knows
(``bytes_held``, ``entries``), and, for caches that report
`CacheHealth` (a remote store's client), breaker state and quarantined holders::

    from prometheus_client import start_http_server
    from mmkey.metrics import MeteredCache

    cache = MeteredCache(MemoryCache(1 << 30), name="vision")
    start_http_server(9400, addr="127.0.0.1")   # serves /metrics

Exported (each with a ``cache`` label naming the wrapped cache):
``mmkey_cache_<counter>_total``, ``mmkey_cache_bytes_held``, ``mmkey_cache_entries``,
``mmkey_cache_call_seconds{operation}`` (histogram), ``mmkey_cache_call_keys_total{operation}``,
``mmkey_cache_breaker_open``, ``mmkey_cache_quarantined_holders``,
``mmkey_cache_holder_quarantined{holder}``, ``mmkey_cache_busy_lanes``,
``mmkey_cache_writes_held``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from mmkey.cache._guard import sync_cache
from mmkey.cache.health import CacheHealth, health_of
from mmkey.cache.protocol import CacheStats, Claim, ClaimingCache, EmbeddingCache
from mmkey.keys import CacheKey

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as _missing:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"mmkey.metrics needs prometheus_client ({_missing}); pip install 'mmkey[metrics]'"
    ) from None

if TYPE_CHECKING:
    import torch

__all__ = ["COUNTERS", "LATENCY_BUCKETS", "OPERATIONS", "MeteredCache"]

T = TypeVar("T")

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Histogram buckets in seconds: 100 µs (a memory hit) to 10 s (a store far past its deadline)."""

OPERATIONS = ("batch_is_exist", "get_embeddings", "insert_batch", "prefetch")
"""The timed operations, the values of the ``operation`` label."""

COUNTERS: dict[str, str] = {
    "hits": "Keys read and returned as a verified tensor.",
    "misses": "Keys read and not served (absent, corrupt, forged, or a store fault).",
    "inserts": "Entries written.",
    "evictions": "Entries dropped to stay within the budget.",
    "corrupt": "Entries that failed verification on read (served as misses).",
    "forged": "Entries whose authentication failed on read (served as misses).",
    "errors": "Store calls that failed or timed out.",
    "skipped": "Calls answered without asking the store (store down, or holders quarantined).",
    "squatted": "Keys written over another client's put session that reserved them unwritten.",
    "unsigned": "Of forged: entries without a MAC, read outside a migration window.",
    "unknown_key": "Of forged: entries naming a secret the keyring does not hold.",
    "expired": "Of forged: entries made with a previous secret past its not-after time.",
    "bad_mac": "Of forged: entries whose MAC, header, key or size did not verify.",
    "unsigned_served": "Entries without a MAC served during a migration window.",
    "oversized": "Entries left unread for being larger than the reader could use.",
    "claims_won": "Keys claimed before encoding them (single-flight).",
    "waits_served": "Keys claimed elsewhere whose entry landed within the wait bound.",
    "waits_timed_out": "Keys claimed elsewhere whose entry did not land within the wait bound.",
    "coalesced": "Keys served by another claimant's encode after a wait (encodes saved).",
}
"""The `CacheStats` counters exported as ``mmkey_cache_<name>_total``, with their help text."""


class _CacheMetrics(Collector):
    """The metrics of every `MeteredCache` on one registry: shared histogram and counter
    objects labelled by cache, plus a collector that reads each cache's stats at scrape."""

    def __init__(self, registry: CollectorRegistry, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.latency = Histogram(
            "mmkey_cache_call_seconds",
            "Seconds each cache call took, by operation.",
            ["cache", "operation"],
            buckets=self.buckets,
            registry=registry,
        )
        self.keys = Counter(
            "mmkey_cache_call_keys",
            "Keys passed to cache calls, by operation.",
            ["cache", "operation"],
            registry=registry,
        )
        self._lock = threading.Lock()
        self._caches: dict[str, weakref.ref[MeteredCache]] = {}
        registry.register(self)

    def add(self, name: str, cache: MeteredCache) -> None:
        with self._lock:
            known = self._caches.get(name)
            if known is not None and known() is not None:
                raise ValueError(
                    f"a MeteredCache named {name!r} is already registered here; give each cache "
                    "its own name= (or close the old one first)"
                )
            self._caches[name] = weakref.ref(cache)

    def remove(self, name: str, cache: MeteredCache) -> None:
        with self._lock:
            if (ref := self._caches.get(name)) is not None and ref() in (cache, None):
                del self._caches[name]
        for operation in OPERATIONS:
            for metric in (self.latency, self.keys):
                with contextlib.suppress(KeyError):
                    metric.remove(name, operation)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            live = [(name, ref()) for name, ref in self._caches.items()]
        caches = [(name, cache) for name, cache in live if cache is not None]
        counters = {
            field: CounterMetricFamily(f"mmkey_cache_{field}", help_text, labels=["cache"])
            for field, help_text in COUNTERS.items()
        }
        held = GaugeMetricFamily(
            "mmkey_cache_bytes_held",
            "Encoded bytes the cache holds (absent where unknown).",
            labels=["cache"],
        )
        entries = GaugeMetricFamily(
            "mmkey_cache_entries", "Entries the cache holds (absent where unknown).", labels=["cache"]
        )
        breaker = GaugeMetricFamily(
            "mmkey_cache_breaker_open", "1 while calls are answered without the store.", labels=["cache"]
        )
        quarantined = GaugeMetricFamily(
            "mmkey_cache_quarantined_holders",
            "Holders whose entries are answered as misses.",
            labels=["cache"],
        )
        holder = GaugeMetricFamily(
            "mmkey_cache_holder_quarantined",
            "1 for each quarantined holder (transfer endpoint).",
            labels=["cache", "holder"],
        )
        lanes = GaugeMetricFamily(
            "mmkey_cache_busy_lanes",
            "Store calls in flight past their caller's deadline.",
            labels=["cache"],
        )
        writes = GaugeMetricFamily(
            "mmkey_cache_writes_held",
            "1 while writes are skipped after one to the store timed out.",
            labels=["cache"],
        )
        for name, cache in caches:
            stats = cache.stats_or_none()
            if stats is not None:
                for field, family in counters.items():
                    family.add_metric([name], getattr(stats, field))
                if stats.bytes_held is not None:
                    held.add_metric([name], stats.bytes_held)
                if stats.entries is not None:
                    entries.add_metric([name], stats.entries)
            report = cache.health()
            if report is not None:
                breaker.add_metric([name], 1.0 if report.breaker_open else 0.0)
                quarantined.add_metric([name], len(report.quarantined))
                for endpoint in report.quarantined:
                    holder.add_metric([name, endpoint], 1.0)
                lanes.add_metric([name], report.busy_lanes)
                writes.add_metric([name], 1.0 if report.writes_held else 0.0)
        yield from counters.values()
        yield from (held, entries, breaker, quarantined, holder, lanes, writes)


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, _CacheMetrics] = weakref.WeakKeyDictionary()
_BY_REGISTRY_LOCK = threading.Lock()


def _metrics_for(registry: CollectorRegistry, buckets: Sequence[float]) -> _CacheMetrics:
    with _BY_REGISTRY_LOCK:
        metrics = _BY_REGISTRY.get(registry)
        if metrics is None:
            metrics = _BY_REGISTRY[registry] = _CacheMetrics(registry, buckets)
        elif metrics.buckets != tuple(buckets):
            raise ValueError(
                f"this registry already times caches with buckets {metrics.buckets}; "
                "use the same buckets= or another registry"
            )
        return metrics


class MeteredCache:
    """An `EmbeddingCache` that times the calls of the cache it wraps and exports its stats.

    ``name`` labels this cache's series (unique per registry among live caches); ``registry``
    defaults to prometheus_client's global one, which its ``start_http_server`` serves.
    Results, errors and `stats()` are the wrapped cache's own, unchanged.
    """

    def __init__(
        self,
        cache: EmbeddingCache,
        *,
        name: str = "default",
        registry: CollectorRegistry | None = None,
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        self._cache = sync_cache(cache, "MeteredCache(cache)")
        label: object = name
        if not isinstance(label, str) or not label:
            raise TypeError(f"MeteredCache name= must be non-empty text, got {name!r}")
        target = REGISTRY if registry is None else registry
        if not isinstance(target, CollectorRegistry):
            raise TypeError(
                f"MeteredCache registry= must be a prometheus_client CollectorRegistry, got {registry!r}"
            )
        self._name = name
        self._metrics = _metrics_for(target, buckets)
        self._timers = {
            operation: (
                self._metrics.latency.labels(name, operation),
                self._metrics.keys.labels(name, operation),
            )
            for operation in OPERATIONS
        }
        self._metrics.add(name, self)
        self._closed = False

    @property
    def cache(self) -> EmbeddingCache:
        """The wrapped cache."""
        return self._cache

    @property
    def name(self) -> str:
        """The ``cache`` label of this cache's series."""
        return self._name

    def _timed(self, operation: str, count: int, call: Callable[[], T]) -> T:
        latency, keys = self._timers[operation]
        started = time.perf_counter()
        result = call()
        latency.observe(time.perf_counter() - started)
        keys.inc(count)
        return result

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """The wrapped cache's answer, timed."""
        return self._timed("batch_is_exist", len(keys), lambda: self._cache.batch_is_exist(keys))

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The wrapped cache's answer, timed."""
        return self._timed("get_embeddings", len(keys), lambda: self._cache.get_embeddings(keys))

    def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        """The wrapped cache's answer, timed."""
        return self._timed("insert_batch", len(keys), lambda: self._cache.insert_batch(keys, embeddings))

    def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """The wrapped cache's answer, timed."""
        return self._timed("prefetch", len(keys), lambda: self._cache.prefetch(keys))

    @property
    def claim_wait(self) -> float:
        """The wrapped cache's ``claim_wait`` where it supports claims, else 0.0 (off)."""
        inner = self._cache
        return inner.claim_wait if isinstance(inner, ClaimingCache) else 0.0

    def claim(self, keys: Sequence[CacheKey]) -> list[Claim]:
        """The wrapped cache's claims (`Claim.UNCLAIMED` for each key where it has none)."""
        inner = self._cache
        return inner.claim(keys) if isinstance(inner, ClaimingCache) else [Claim.UNCLAIMED] * len(keys)

    def release(self, keys: Sequence[CacheKey]) -> None:
        """Release the wrapped cache's claims of the keys."""
        inner = self._cache
        if isinstance(inner, ClaimingCache):
            inner.release(keys)

    def wait_for_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The wrapped cache's bounded wait for keys claimed elsewhere."""
        inner = self._cache
        return inner.wait_for_embeddings(keys) if isinstance(inner, ClaimingCache) else [None] * len(keys)

    def stats(self) -> CacheStats:
        """The wrapped cache's stats."""
        return self._cache.stats()

    def stats_or_none(self) -> CacheStats | None:
        """The wrapped cache's stats, or ``None`` when it cannot give them (closed, failing)."""
        if self._closed:
            return None
        try:
            return self._cache.stats()
        except Exception:
            return None

    def health(self) -> CacheHealth | None:
        """The wrapped cache's `CacheHealth` where it reports one, else ``None``."""
        return None if self._closed else health_of(self._cache)

    def close(self) -> None:
        """Close the wrapped cache and drop this cache's series. Idempotent."""
        if not self._closed:
            self._closed = True
            self._metrics.remove(self._name, self)
        self._cache.close()

    def __enter__(self) -> MeteredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MeteredCache({self._cache!r}, name={self._name!r})"
