"""`CacheHealth`: what a cache can say about its store beyond counters, and the hook to ask.

A cache over a remote store implements ``health() -> CacheHealth`` (the `ReportsHealth`
protocol); `mmkey.metrics` exports it as breaker and quarantine gauges. Caches without a
store (`MemoryCache`) do not implement it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

__all__ = ["CacheHealth", "ReportsHealth", "health_of"]


def _endpoints(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (tuple, list, frozenset, set)):
        raise TypeError(f"CacheHealth.quarantined takes holder endpoints (a tuple of str), got {value!r}")
    items = tuple(sorted(value))
    if not all(isinstance(item, str) for item in items):
        raise TypeError(f"CacheHealth.quarantined takes holder endpoints (str), got {value!r}")
    return items


@attrs.frozen(slots=True, kw_only=True)
class CacheHealth:
    """A snapshot of a cache's view of its store; never updated in place."""

    breaker_open: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Calls are answered without the store (as misses) until it answers again."""
    quarantined: tuple[str, ...] = attrs.field(default=(), converter=_endpoints)
    """Holders (transfer endpoints, ``"host:port"``, sorted) whose entries are answered as
    misses without calling the store, after a transfer from them failed or timed out."""
    busy_lanes: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    """Store calls in flight past their caller's deadline (a lane stuck in the binding)."""
    writes_held: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Writes are skipped (not stored, no claims) after one timed out: the master places a
    write, so the hung holder is not known; one trial write every ``retry_after`` seconds."""

    def merged(self, other: CacheHealth) -> CacheHealth:
        """Both views at once (the tiers of a `TieredCache`): open if either is, every holder."""
        return CacheHealth(
            breaker_open=self.breaker_open or other.breaker_open,
            quarantined=tuple(set(self.quarantined) | set(other.quarantined)),
            busy_lanes=self.busy_lanes + other.busy_lanes,
            writes_held=self.writes_held or other.writes_held,
        )


@runtime_checkable
class ReportsHealth(Protocol):
    """A cache that can report `CacheHealth` (a cache over a remote store)."""

    def health(self) -> CacheHealth:
        """A snapshot of the cache's view of its store."""
        ...


def health_of(cache: object) -> CacheHealth | None:
    """``cache.health()`` where the cache reports it, else ``None``; a failing hook is ``None``."""
    if not isinstance(cache, ReportsHealth):
        return None
    try:
        report: object = cache.health()  # a wrapper may answer None: it knows no store
    except Exception:  # a cache that is closing or broken reports nothing
        return None
    return report if isinstance(report, CacheHealth) else None
