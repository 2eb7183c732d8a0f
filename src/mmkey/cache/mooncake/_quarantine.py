"""Holder quarantine: segment holders whose transfers failed, answered without the store.

A read of an entry on a hung holder blocks inside Mooncake for up to 30 s (Mooncake reads
the first replica the master lists and does not fail over within a call). Once a transfer
from a holder (named by its transfer endpoint, ``"host:port"``) timed out or failed, reads
that would go to it are misses at once. One probe per holder, `retry_after` seconds after it
was quarantined, checks whether it answers again (or the master no longer lists it); either
lifts it. A probe of a hung holder keeps a client thread busy until the transfer's deadline,
so each probe that fails doubles the wait before the next, up to `longest`. So does
a transfer that timed out and then completed: on a busy host a healthy holder's transfer can
miss a short deadline, and its late answer proves the holder works.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import attrs

__all__ = ["Quarantine"]

_PROBE_KEYS = 3
"""Keys kept per holder to probe it with (ones that were read from it when it failed)."""


@attrs.define(slots=True)
class _Held:
    since: float
    keys: list[str]
    last_probe: float
    wait: float
    """Seconds from the last probe to the next."""
    probing: bool = False


class Quarantine:
    """The holders under quarantine; thread-safe."""

    def __init__(
        self, retry_after: float, clock: Callable[[], float] = time.monotonic, longest: float | None = None
    ) -> None:
        if longest is not None and longest < retry_after:
            raise ValueError(f"longest ({longest}) must be at least retry_after ({retry_after})")
        self._retry_after = retry_after
        self._longest = retry_after if longest is None else longest
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._answered: dict[str, float] = {}  # when each holder last completed a late transfer
        self._lock = threading.Lock()

    def add(self, endpoint: str, keys: Sequence[str], *, since: float | None = None) -> bool:
        """Quarantine `endpoint` (a transfer to it failed; `keys` were read from it); whether
        it was newly added. A holder that completed a late transfer at or after `since` (when
        the failed transfer started) is not quarantined: it answered after that transfer began."""
        with self._lock:
            if since is not None and self._answered.get(endpoint, float("-inf")) >= since:
                return False
            held = self._held.get(endpoint)
            if held is not None:
                held.keys = list(dict.fromkeys([*keys, *held.keys]))[:_PROBE_KEYS]
                return False
            now = self._clock()
            self._held[endpoint] = _Held(
                since=now, keys=list(keys)[:_PROBE_KEYS], last_probe=now, wait=self._retry_after
            )
            return True

    def lift(self, endpoint: str) -> None:
        """Re-admit `endpoint`."""
        with self._lock:
            self._held.pop(endpoint, None)

    def answered(self, endpoint: str) -> bool:
        """A transfer from `endpoint` that its caller gave up on completed in full: re-admit
        it, and quarantine it again only for a transfer started after now; whether it was held."""
        with self._lock:
            self._answered[endpoint] = self._clock()
            return self._held.pop(endpoint, None) is not None

    def holds(self, endpoint: str) -> bool:
        """Whether `endpoint` is quarantined."""
        return endpoint in self._held

    def endpoints(self) -> tuple[str, ...]:
        """The quarantined endpoints, sorted."""
        with self._lock:
            return tuple(sorted(self._held))

    def __bool__(self) -> bool:
        return bool(self._held)

    def due_probes(self) -> list[tuple[str, list[str]]]:
        """Holders to probe now (with the keys to probe them by): those whose wait since their
        last probe (`retry_after`, doubled by each failed probe up to `longest`) has passed
        and no probe of them still running. Marks them as probing."""
        now = self._clock()
        due: list[tuple[str, list[str]]] = []
        with self._lock:
            for endpoint, held in self._held.items():
                if not held.probing and now - held.last_probe >= held.wait:
                    held.probing, held.last_probe = True, now
                    due.append((endpoint, list(held.keys)))
        return due

    def probed(self, endpoint: str, *, healthy: bool) -> None:
        """A probe of `endpoint` ended: lift it if `healthy`, else keep it until the next,
        twice as far off as this one was (at most `longest`)."""
        with self._lock:
            held = self._held.get(endpoint)
            if held is None:
                return
            if healthy:
                del self._held[endpoint]
            else:
                held.probing, held.last_probe = False, self._clock()
                held.wait = min(held.wait * 2, self._longest)
