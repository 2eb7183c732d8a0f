"""The lane (a worker thread each call waits for until its give-up time, by an injected clock)
and the circuit breaker behind the Mooncake adapter."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from mmkey._deadline import Breaker, CallTimeout, Done, Failed, Lane, Outcome, Why
from mmkey.errors import StoreClosed, StoreError
from tests._clock import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def lane(clock: FakeClock) -> Iterator[Lane]:
    lane = Lane("test", clock)
    yield lane
    lane.close()
    assert lane.join(10)


def hung(clock: FakeClock, release: threading.Event, seconds: float, value: object = None) -> object:
    """A call that hangs: the clock moves `seconds` on while it is blocked, until `release`."""
    clock.advance(seconds)
    assert release.wait(30)
    return value


def failed(outcome: Outcome[object], why: Why) -> BaseException:
    assert isinstance(outcome, Failed) and outcome.why is why, outcome
    return outcome.error


def test_a_call_answers_its_value_or_what_it_raised(lane: Lane, clock: FakeClock) -> None:
    assert lane.run(lambda: 41 + 1, clock() + 5) == Done(42)

    def boom() -> int:
        raise KeyError("x")

    assert isinstance(failed(lane.run(boom, clock() + 5), Why.RAISED), KeyError)


def test_a_hung_call_times_out_by_the_clock_and_is_stuck_once_past_the_timeout(
    lane: Lane, clock: FakeClock
) -> None:
    release = threading.Event()
    start = clock()
    error = failed(lane.run(lambda: hung(clock, release, 10.0), start + 1.0), Why.TIMED_OUT)
    assert isinstance(error, CallTimeout) and issubclass(CallTimeout, StoreError)
    assert clock() - start == 10.0, "the wait ended by the clock, not the wall"
    assert lane.is_busy() and lane.is_stuck(5.0) and not lane.is_stuck(20.0)
    release.set()
    assert lane.run(lambda: "after", clock() + 5) == Done("after")
    assert not lane.is_busy() and not lane.is_stuck(0.0)


def test_a_call_still_queued_at_its_give_up_time_never_runs(lane: Lane, clock: FakeClock) -> None:
    release = threading.Event()
    running = lane.submit(lambda: hung(clock, release, 2.0, "first"))
    ran: list[str] = []
    assert not lane.is_stuck(5.0), "a call that just started is worth queueing behind"
    # its give-up time is now: it is still queued behind the hung call, so it is cancelled
    failed(lane.run(lambda: ran.append("queued"), clock()), Why.NOT_STARTED)
    release.set()
    assert lane.wait(running, clock() + 5) == Done("first")
    assert lane.run(lambda: "after", clock() + 5) == Done("after")
    assert ran == []


def test_calls_run_one_at_a_time_in_order(lane: Lane, clock: FakeClock) -> None:
    seen: list[int] = []
    active = 0
    overlap = False
    guard = threading.Lock()

    def task(i: int) -> int:
        nonlocal active, overlap
        with guard:
            active += 1
            overlap |= active > 1
        seen.append(i)
        with guard:
            active -= 1
        return i

    tickets = [lane.submit(lambda i=i: task(i)) for i in range(200)]  # type: ignore[misc]
    assert [lane.wait(t, clock() + 5) for t in tickets] == [Done(i) for i in range(200)]
    assert seen == list(range(200)) and not overlap


def test_breaker_opens_on_failure_and_lets_one_trial_through_after_the_wait() -> None:
    clock = FakeClock()
    breaker = Breaker(retry_after=2.0, clock=clock)
    assert breaker.allow() and not breaker.is_open()
    breaker.failure()
    assert breaker.is_open() and not breaker.allow()
    clock.advance(1.9)
    assert not breaker.allow()
    clock.advance(0.2)
    assert breaker.allow()  # the trial
    assert not breaker.allow()  # only one per period
    breaker.success()
    assert breaker.allow() and breaker.allow() and not breaker.is_open()


def test_a_failed_trial_reopens_the_breaker() -> None:
    clock = FakeClock()
    breaker = Breaker(retry_after=1.0, clock=clock)
    breaker.failure()
    clock.advance(1.5)
    assert breaker.allow()
    breaker.failure()
    assert not breaker.allow()
    clock.advance(1.01)
    assert breaker.allow()


def test_each_failed_trial_doubles_the_wait_up_to_longest_and_a_success_starts_over() -> None:
    clock = FakeClock()
    breaker = Breaker(retry_after=1.0, clock=clock, longest=4.0)
    breaker.failure()
    breaker.failure()  # a second failure, not of a trial: the wait stays
    assert breaker.wait == 1.0
    for wait in (1.0, 2.0, 4.0, 4.0):
        clock.advance(wait - 0.01)
        assert not breaker.allow(), f"a trial before its wait of {wait} s"
        clock.advance(0.01)
        assert breaker.allow()  # the trial
        breaker.failure()
    assert breaker.wait == 4.0
    clock.advance(4.0)
    assert breaker.allow()
    breaker.success()
    assert breaker.wait == 1.0 and not breaker.is_open()
    breaker.failure()
    clock.advance(1.0)
    assert breaker.allow(), "after a success the wait is retry_after again"
    with pytest.raises(ValueError, match="at least retry_after"):
        Breaker(retry_after=2.0, clock=clock, longest=1.0)


def test_the_value_of_an_abandoned_call_is_handed_over_for_release(lane: Lane, clock: FakeClock) -> None:
    release = threading.Event()
    handed: list[object] = []
    done = threading.Event()

    def hand(value: object) -> None:
        handed.append(value)
        done.set()

    failed(lane.run(lambda: hung(clock, release, 5.0, "lease"), clock() + 1.0, hand), Why.TIMED_OUT)
    assert handed == []
    release.set()
    assert done.wait(10) and handed == ["lease"]


def test_abandoned_is_not_called_for_a_failed_or_a_cancelled_call(lane: Lane, clock: FakeClock) -> None:
    release = threading.Event()
    handed: list[object] = []
    ran: list[str] = []

    def fail() -> str:
        hung(clock, release, 5.0)
        raise KeyError("store error")

    failed(lane.run(fail, clock() + 1.0, handed.append), Why.TIMED_OUT)
    # queued behind the stuck call, this one times out before it starts: it is cancelled
    failed(lane.run(lambda: ran.append("ran"), clock(), handed.append), Why.NOT_STARTED)
    release.set()
    assert lane.run(lambda: "next", clock() + 5) == Done("next")
    assert handed == [] and ran == []


def test_an_exception_in_the_waiting_thread_hands_the_value_over(lane: Lane, clock: FakeClock) -> None:
    # e.g. KeyboardInterrupt while the caller waits: what the call holds is released
    import signal

    release = threading.Event()
    handed: list[object] = []
    done = threading.Event()

    def hand(value: object) -> None:
        handed.append(value)
        done.set()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            lane.run(lambda: hung(clock, release, 0.0, "lease"), clock() + 10, hand)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    release.set()
    assert done.wait(10) and handed == ["lease"]


def test_close_releases_waiting_callers_at_once_and_stops_the_worker(clock: FakeClock) -> None:
    lane = Lane("test", clock)
    release, started = threading.Event(), threading.Event()
    handed: list[object] = []
    outcome: list[Outcome[object]] = []

    def hold() -> str:
        started.set()
        assert release.wait(30)
        return "lease"

    first = lane.submit(hold)
    queued = lane.submit(lambda: "never")
    waiter = threading.Thread(target=lambda: outcome.append(lane.wait(first, clock() + 30, handed.append)))
    waiter.start()
    assert started.wait(10)
    lane.close()
    waiter.join(10)
    assert not waiter.is_alive()
    assert isinstance(failed(outcome[0], Why.CLOSED), StoreClosed)
    failed(lane.wait(queued, clock() + 1), Why.CLOSED)
    failed(lane.run(lambda: "late", clock() + 30), Why.CLOSED)
    assert handed == []
    release.set()
    assert lane.join(10)
    assert handed == ["lease"]
