"""What a busy process reports: thread-safe counters and a rate-limited log.

A serving host logs at most a line per kind of problem per period, however often the
problem repeats; the counts say how often it did.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Counters", "RateLimitedLog"]

_SUMMARY = object()
"""The kind under which `RateLimitedLog.note` keeps its period."""


def _later(delay: float, call: Callable[[], None]) -> None:
    """Run `call` on a daemon timer thread in `delay` seconds."""
    timer = threading.Timer(delay, call)
    timer.daemon = True
    timer.start()


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
    counts by reason, all reasons in one line, at most once a period. Counts a period holds
    back are reported when it ends (``later`` runs the report then), whether more events
    come or not; `count` and `report` let a caller count a burst first and report it whole.
    ``clock`` and ``later`` are for tests.
    """

    def __init__(
        self,
        logger: logging.Logger,
        level: int,
        template: str,
        *,
        period: float,
        clock: Callable[[], float] = time.monotonic,
        later: Callable[[float, Callable[[], None]], None] = _later,
    ) -> None:
        self._logger = logger
        self._level = level
        self._template = template
        self._period = period
        self._clock = clock
        self._later = later
        self._last: dict[object, float] = {}
        self._held: dict[str, int] = {}
        self._reasons: dict[str, int] = {}
        self._report_due = False  # a report of held-back counts is scheduled
        self._lock = threading.Lock()

    def _due(self, kind: object, now: float) -> bool:
        last = self._last.get(kind)
        if last is not None and now - last < self._period:
            return False
        self._last[kind] = now
        return True

    def __call__(self, kind: str, message: str, *, exc_info: bool = False) -> None:
        """Log ``message`` unless a ``kind`` problem was logged less than a period ago."""
        now = self._clock()
        with self._lock:
            if not self._due(kind, now):
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            held = self._held.pop(kind, 0)
        more = f" ({held} more like it since the last report)" if held else ""
        self._logger.log(self._level, self._template, message, more, exc_info=exc_info)

    def note(self, reason: str) -> None:
        """Count one event of ``reason`` and `report`."""
        self.count(reason)
        self.report()

    def count(self, reason: str) -> None:
        """Count one event of ``reason`` for the next `report`, logging nothing."""
        with self._lock:
            self._reasons[reason] = self._reasons.get(reason, 0) + 1

    def report(self) -> None:
        """Log the counts by reason since the last such line (``"3 holder quarantined, 1 every
        transfer lane stuck"``), or, less than a period after it, schedule that for the
        period's end."""
        now = self._clock()
        with self._lock:
            if not self._reasons:
                return
            if not self._due(_SUMMARY, now):
                if self._report_due:
                    return
                self._report_due = True
                delay = self._last[_SUMMARY] + self._period - now
                counts = None
            else:
                counts, self._reasons = self._reasons, {}
        if counts is None:
            self._later(delay, self._scheduled_report)
            return
        summary = ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
        self._logger.log(self._level, self._template, summary, "")

    def _scheduled_report(self) -> None:
        with self._lock:
            self._report_due = False
        self.report()
