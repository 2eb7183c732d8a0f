"""Deadlines for blocking store calls: one daemon worker thread and a circuit breaker.

A store binding can block for tens of seconds when its server hangs. Every call goes to
a single worker thread (so calls into the binding never overlap) and the caller waits
at most a deadline for it. Calls queue behind a healthy call; once the running call has
outlived its deadline (`is_stuck`) the adapter answers from its fallback at once instead
of queueing behind it, and a call that timed out in the queue is cancelled, never run.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from mmkey.errors import StoreError

__all__ = ["Breaker", "CallTimeout", "DeadlineRunner"]

T = TypeVar("T")


class CallTimeout(StoreError):
    """A store call did not finish within its deadline (it may still finish later)."""


class DeadlineRunner:
    """Runs callables one at a time on a daemon thread; callers wait at most a deadline."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], object], Future[object]] | None] = (
            queue.SimpleQueue()
        )
        self._pending = 0
        self._running_since: float | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def is_busy(self) -> bool:
        """Whether an earlier call is still queued or running."""
        with self._lock:
            return self._pending > 0

    def is_stuck(self, after: float) -> bool:
        """Whether the call running now started more than `after` seconds ago.

        Calls queued behind a healthy call are worth waiting for (each caller still waits
        at most its deadline); calls behind a stuck one are not.
        """
        with self._lock:
            since = self._running_since
        return since is not None and time.monotonic() - since > after

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn`; its future completes when the worker has run it."""
        future: Future[T] = Future()
        with self._lock:
            self._pending += 1
        self._tasks.put((fn, future))  # type: ignore[arg-type]
        return future

    def call(
        self,
        fn: Callable[[], T],
        deadline: float,
        abandoned: Callable[[T], object] | None = None,
    ) -> T:
        """Run `fn` on the worker and return its result, or raise `CallTimeout`.

        A call that times out before the worker started it is cancelled: it never runs.
        One that times out while running hands its eventual result to `abandoned` (to
        release what the result holds), since no caller will.
        """
        future = self.submit(fn)
        try:
            return future.result(timeout=deadline)
        except FutureTimeout:
            if not future.cancel() and abandoned is not None:
                hand_over = abandoned

                def release(done: Future[T]) -> None:
                    if done.exception() is None:
                        hand_over(done.result())

                future.add_done_callback(release)
            raise CallTimeout(f"store call still running after {deadline:.3g} s") from None

    def stop(self) -> None:
        """Let the worker exit once the calls already queued have run."""
        self._tasks.put(None)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, future = task
            try:
                if future.set_running_or_notify_cancel():
                    with self._lock:
                        self._running_since = time.monotonic()
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # handed to the caller
                        future.set_exception(exc)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._running_since = None


class Breaker:
    """Closed while calls succeed; open for `retry_after` seconds after a failure, then
    lets one trial call through (half-open) before closing again on success."""

    def __init__(self, retry_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._retry_after = retry_after
        self._clock = clock
        self._open_until: float | None = None
        self._lock = threading.Lock()

    def is_open(self) -> bool:
        """Whether calls are being refused right now."""
        with self._lock:
            return self._open_until is not None and self._clock() < self._open_until

    def allow(self) -> bool:
        """Whether a call may go to the store now; a trial call re-arms the wait."""
        with self._lock:
            if self._open_until is None:
                return True
            now = self._clock()
            if now < self._open_until:
                return False
            self._open_until = now + self._retry_after  # one trial per period
            return True

    def success(self) -> None:
        """A call succeeded: close the breaker."""
        with self._lock:
            self._open_until = None

    def failure(self) -> None:
        """A call failed or timed out: refuse calls for `retry_after` seconds."""
        with self._lock:
            self._open_until = self._clock() + self._retry_after
