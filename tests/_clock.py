"""A clock for logic tests: its time moves only when a test (or a call it runs) advances it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import Any

from mmkey._deadline import Clock

WALL_LIMIT_S = 30.0
"""The longest a wait on this clock blocks in wall time: a test that never advances the clock
past a hung call's bound fails instead of hanging."""


class FakeClock(Clock):
    """Monotonic seconds that move by `advance` only.

    A wait for a call returns once the call settles, or once the clock has been advanced past
    the wait's bound (a hung call that advances the clock itself times out at once, with no
    sleep).
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds

    def wait(self, future: concurrent.futures.Future[Any], seconds: float) -> bool:
        until = self._now + seconds
        wall_limit = time.monotonic() + WALL_LIMIT_S
        while not future.done():
            if self._now >= until:
                return False
            assert time.monotonic() < wall_limit, "the fake clock was never advanced past this wait"
            with contextlib.suppress(concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                future.exception(0.001)
        return True
