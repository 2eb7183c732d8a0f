"""The deadline runner and the circuit breaker behind the Mooncake adapter."""

from __future__ import annotations

import threading

import pytest

from mmkey._deadline import Breaker, CallTimeout, DeadlineRunner
from mmkey.errors import StoreError


def test_runner_returns_results_and_raises_errors_of_the_call() -> None:
    runner = DeadlineRunner("test")
    assert runner.call(lambda: 41 + 1, timeout=5) == 42

    def boom() -> int:
        raise KeyError("x")

    with pytest.raises(KeyError):
        runner.call(boom, timeout=5)
    runner.stop()


def test_a_stuck_call_times_out_and_keeps_the_runner_busy_until_it_ends() -> None:
    runner = DeadlineRunner("test")
    release = threading.Event()
    with pytest.raises(CallTimeout):
        runner.call(lambda: release.wait(10), timeout=0.05)
    assert runner.is_busy()
    release.set()
    assert runner.call(lambda: "after", timeout=5) == "after"
    assert not runner.is_busy()
    assert issubclass(CallTimeout, StoreError)
    runner.stop()


def test_a_call_is_stuck_only_once_it_outlives_the_timeout_and_queued_timeouts_never_run() -> None:
    runner = DeadlineRunner("test")
    release = threading.Event()
    ran: list[str] = []
    running = runner.submit(lambda: release.wait(10))
    assert not runner.is_stuck(5.0), "a call that just started is worth queueing behind"
    with pytest.raises(CallTimeout):
        runner.call(lambda: ran.append("queued"), timeout=0.1)
    assert runner.is_stuck(0.05)
    release.set()
    running.result(timeout=5)
    assert runner.call(lambda: "after", timeout=5) == "after"
    assert ran == [], "a call that timed out before it started is cancelled"
    assert not runner.is_stuck(0.0)
    runner.stop()


def test_calls_run_one_at_a_time_in_order() -> None:
    runner = DeadlineRunner("test")
    seen: list[int] = []
    active = 0
    overlap = False
    lock = threading.Lock()

    def task(i: int) -> None:
        nonlocal active, overlap
        with lock:
            active += 1
            overlap |= active > 1
        seen.append(i)
        with lock:
            active -= 1

    futures = [runner.submit(lambda i=i: task(i)) for i in range(200)]  # type: ignore[misc]
    for f in futures:
        f.result(timeout=5)
    assert seen == list(range(200)) and not overlap
    runner.stop()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_on_failure_and_lets_one_trial_through_after_the_wait() -> None:
    clock = FakeClock()
    breaker = Breaker(retry_after=2.0, clock=clock)
    assert breaker.allow() and not breaker.is_open()
    breaker.failure()
    assert breaker.is_open() and not breaker.allow()
    clock.now += 1.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow()  # the trial
    assert not breaker.allow()  # only one per period
    breaker.success()
    assert breaker.allow() and breaker.allow() and not breaker.is_open()


def test_a_failed_trial_reopens_the_breaker() -> None:
    clock = FakeClock()
    breaker = Breaker(retry_after=1.0, clock=clock)
    breaker.failure()
    clock.now += 1.5
    assert breaker.allow()
    breaker.failure()
    assert not breaker.allow()
    clock.now += 1.01
    assert breaker.allow()


def test_the_result_of_an_abandoned_call_is_handed_over_for_release() -> None:
    runner = DeadlineRunner("test")
    release = threading.Event()
    handed: list[str] = []
    done = threading.Event()

    def hand(result: str) -> None:
        handed.append(result)
        done.set()

    with pytest.raises(CallTimeout):
        runner.call(lambda: (release.wait(10), "lease")[1], timeout=0.05, abandoned=hand)
    assert handed == []
    release.set()
    assert done.wait(5) and handed == ["lease"]
    runner.stop()


def test_abandoned_is_not_called_for_a_failed_or_a_cancelled_call() -> None:
    runner = DeadlineRunner("test")
    release = threading.Event()
    handed: list[object] = []
    ran: list[str] = []

    def fail() -> str:
        release.wait(10)
        raise KeyError("store error")

    with pytest.raises(CallTimeout):
        runner.call(fail, timeout=0.05, abandoned=handed.append)
    # queued behind the stuck call, this one times out before it starts: it is cancelled
    with pytest.raises(CallTimeout):
        runner.call(lambda: ran.append("ran"), timeout=0.05, abandoned=handed.append)
    release.set()
    assert runner.call(lambda: "next", timeout=5) == "next"
    assert handed == [] and ran == []
    runner.stop()


def test_an_exception_in_the_waiting_thread_hands_the_result_over() -> None:
    # e.g. KeyboardInterrupt while the caller waits: what the call holds is released
    import signal

    runner = DeadlineRunner("test")
    release = threading.Event()
    handed: list[str] = []
    done = threading.Event()

    def hand(result: str) -> None:
        handed.append(result)
        done.set()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            runner.call(lambda: (release.wait(10), "lease")[1], timeout=10, abandoned=hand)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    release.set()
    assert done.wait(5) and handed == ["lease"]
    runner.stop()


def test_close_releases_waiting_callers_at_once_and_stops_the_worker() -> None:
    from mmkey.errors import StoreClosed

    runner = DeadlineRunner("test")
    release, started = threading.Event(), threading.Event()
    handed: list[str] = []
    outcome: list[BaseException] = []

    def hold() -> str:
        started.set()
        release.wait(10)
        return "lease"

    def waiter() -> None:
        try:
            runner.call(hold, timeout=30, abandoned=handed.append)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert started.wait(5)
    runner.close()
    thread.join(5)
    assert not thread.is_alive() and isinstance(outcome[0], StoreClosed)
    with pytest.raises(StoreClosed):
        runner.call(lambda: "late", timeout=30)
    release.set()
    assert runner.join(5)
    assert handed == ["lease"]
