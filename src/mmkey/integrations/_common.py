"""Parts both integrations use: thread-safe counters and a per-kind rate-limited log."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["Counters", "RateLimitedLog"]


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
    """Logs each kind of problem at most once per ``period`` seconds, with how many were
    held back since the last report.

    ``template`` is the log format with two ``%s``: the message, then the held-back note.
    """

    def __init__(self, logger: logging.Logger, level: int, template: str, *, period: float) -> None:
        self._logger = logger
        self._level = level
        self._template = template
        self._period = period
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, message: str, *, exc_info: bool = False) -> None:
        """Log ``message`` unless a ``kind`` problem was logged less than a period ago."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._period:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        more = f" ({held} more like it since the last report)" if held else ""
        self._logger.log(self._level, self._template, message, more, exc_info=exc_info)
