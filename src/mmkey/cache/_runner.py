"""Deadlines for blocking store calls: a daemon worker thread (a lane) and a circuit breaker.

A store binding can block for tens of seconds when its server hangs. Every call goes to
a worker thread and the caller waits at most a deadline for it. Calls queue behind a
healthy call; once the running call has outlived its deadline (`is_stuck`) the adapter
answers from its fallback at once instead of queueing behind it, and a call that timed
out in the queue is cancelled, never run. A caller that stops waiting for any reason (the
deadline, ``KeyboardInterrupt``, the lane closing) hands the call's eventual result to a
release function, so nothing it holds (a staging lease) is lost.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TypeVar

from mmkey.errors import StoreClosed, StoreError

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
        self._closing: Future[None] = Future()
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

        A call that the caller stops waiting for before the worker started it is cancelled:
        it never runs. One that is already running hands its eventual result to `abandoned`
        (to release what the result holds), since no caller will. That holds whatever ends
        the wait: the deadline (`CallTimeout`), `close` (`StoreClosed`) or an exception
        raised in the waiting thread (``KeyboardInterrupt``), which propagates.
        """
        return self.wait_for(self.submit(fn), deadline, abandoned)

    def wait_for(
        self,
        future: Future[T],
        deadline: float,
        abandoned: Callable[[T], object] | None = None,
    ) -> T:
        """Wait at most `deadline` seconds for a `submit`-ted call, as `call` does."""
        try:
            pending: tuple[Future[object], ...] = (future, self._closing)  # type: ignore[assignment]
            wait(pending, timeout=max(deadline, 0.0), return_when=FIRST_COMPLETED)
        except BaseException:
            self._abandon(future, abandoned)
            raise
        if future.done():
            return future.result()
        self._abandon(future, abandoned)
        if self._closing.done():
            raise StoreClosed("the store was closed while this call waited")
        raise CallTimeout(f"store call still running after {deadline:.3g} s")

    @staticmethod
    def _abandon(future: Future[T], abandoned: Callable[[T], object] | None) -> None:
        if future.cancel() or abandoned is None:
            return
        hand_over = abandoned

        def release(done: Future[T]) -> None:
            if not done.cancelled() and done.exception() is None:
                hand_over(done.result())

        future.add_done_callback(release)  # runs at once if the call is already done

    def stop(self) -> None:
        """Let the worker exit once the calls already queued have run."""
        self._tasks.put(None)

    def close(self) -> None:
        """Stop waiting: callers waiting now or later get `StoreClosed` at once, queued calls
        that nobody waits for are cancelled, and the worker exits after the calls queued."""
        if not self._closing.done():
            self._closing.set_result(None)
        self.stop()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the worker to exit; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

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
