"""What a busy process reports: thread-safe counters and a rate-limited log.

A serving host logs at most a line per kind of problem per period, however often the
problem repeats; the counts say how often it did.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["Counters", "RateLimitedLog"]

_SUMMARY = object()
"""The kind under which `RateLimitedLog.note` keeps its period."""


class Counters:
    """Named counters (thread-safe): totals since creation and the part since the last `take`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, int] = {}
        self._total: dict[str, int] = {}

    def add(self, **deltas: int) -> None:
        """Add each delta to its counter (a zero delta creates no entry)."""
        with self._lock:
            for name, delta in deltas.items():
                if delta:
                    self._data[name] = self._data.get(name, 0) + delta
                    self._total[name] = self._total.get(name, 0) + delta

    def take(self) -> dict[str, int]:
        """The counts since the last call, resetting them."""
        with self._lock:
            data, self._data = self._data, {}
            return data

    def totals(self) -> dict[str, int]:
        """Every count since creation (counters never added to are absent)."""
        with self._lock:
            return dict(self._total)


class RateLimitedLog:
    """Logs each kind of problem at most once per ``period`` seconds.

    ``template`` is the log format with two ``%s``: the message, then a note of what was
    held back. Calling the log reports one problem of a kind, with how many of that kind
    were held back since its last report; `note` counts events by reason and reports the
    counts by reason, all reasons in one line, at most once a period.
    """

    def __init__(self, logger: logging.Logger, level: int, template: str, *, period: float) -> None:
        self._logger = logger
        self._level = level
        self._template = template
        self._period = period
        self._last: dict[object, float] = {}
        self._held: dict[str, int] = {}
        self._reasons: dict[str, int] = {}
        self._lock = threading.Lock()

    def _due(self, kind: object, now: float) -> bool:
        last = self._last.get(kind)
        if last is not None and now - last < self._period:
            return False
        self._last[kind] = now
        return True

    def __call__(self, kind: str, message: str, *, exc_info: bool = False) -> None:
        """Log ``message`` unless a ``kind`` problem was logged less than a period ago."""
        now = time.monotonic()
        with self._lock:
            if not self._due(kind, now):
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            held = self._held.pop(kind, 0)
        more = f" ({held} more like it since the last report)" if held else ""
        self._logger.log(self._level, self._template, message, more, exc_info=exc_info)

    def note(self, reason: str) -> None:
        """Count one event of ``reason``; log the counts by reason since the last such line
        (``"3 holder quarantined, 1 every transfer lane stuck"``) unless one was logged less
        than a period ago."""
        now = time.monotonic()
        with self._lock:
            self._reasons[reason] = self._reasons.get(reason, 0) + 1
            if not self._due(_SUMMARY, now):
                return
            counts, self._reasons = self._reasons, {}
        summary = ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
        self._logger.log(self._level, self._template, summary, "")
