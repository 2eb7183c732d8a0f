"""The rate-limited log and the counters that the Mooncake client and both integrations share."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest

from mmkey._log import Counters, RateLimitedLog

_LOGGER = logging.getLogger("mmkey.test_log")


def test_each_kind_is_logged_once_a_period_with_what_was_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = RateLimitedLog(_LOGGER, logging.WARNING, "problem: %s%s", period=10.0)
    with caplog.at_level(logging.WARNING, logger=_LOGGER.name):
        log("a", "first a")
        log("b", "first b")  # another kind is not held back
        for _ in range(3):
            log("a", "again a")
    assert [r.getMessage() for r in caplog.records] == ["problem: first a", "problem: first b"]
    log._last["a"] -= 11.0  # the period has passed for kind "a"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=_LOGGER.name):
        log("a", "later a")
    assert [r.getMessage() for r in caplog.records] == [
        "problem: later a (3 more like it since the last report)"
    ]


class Later:
    """A clock and a scheduler for the log: scheduled reports run when `advance` passes them."""

    def __init__(self) -> None:
        self.now = 0.0
        self.scheduled: list[tuple[float, Callable[[], None]]] = []

    def __call__(self) -> float:
        return self.now

    def schedule(self, delay: float, call: Callable[[], None]) -> None:
        self.scheduled.append((self.now + delay, call))

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [call for at, call in self.scheduled if at <= self.now]
        self.scheduled = [(at, call) for at, call in self.scheduled if at > self.now]
        for call in due:
            call()


def test_notes_are_summed_by_reason_into_one_line_a_period(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(_LOGGER, logging.WARNING, "skipped: %s%s", period=10.0, later=lambda *_: None)
    with caplog.at_level(logging.WARNING, logger=_LOGGER.name):
        log.note("x")
        log.note("y")
        log.note("y")
    assert [r.getMessage() for r in caplog.records] == ["skipped: 1 x"]
    for last in log._last:
        log._last[last] -= 11.0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=_LOGGER.name):
        log.note("x")
    assert [r.getMessage() for r in caplog.records] == ["skipped: 1 x, 2 y"]


def test_a_burst_of_several_kinds_is_reported_whole_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = Later()
    log = RateLimitedLog(
        _LOGGER, logging.WARNING, "refused: %s%s", period=10.0, clock=clock, later=clock.schedule
    )
    with caplog.at_level(logging.WARNING, logger=_LOGGER.name):
        for reason in ["bad_mac", "unsigned", "bad_mac", "corrupt", "unknown_key", "unsigned", "bad_mac"]:
            log.count(reason)
        log.report()
    assert [r.getMessage() for r in caplog.records] == [
        "refused: 3 bad_mac, 1 corrupt, 1 unknown_key, 2 unsigned"
    ]


def test_counts_a_period_held_back_are_reported_at_its_end_without_a_later_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Later()
    log = RateLimitedLog(
        _LOGGER, logging.WARNING, "refused: %s%s", period=10.0, clock=clock, later=clock.schedule
    )
    with caplog.at_level(logging.WARNING, logger=_LOGGER.name):
        log.note("bad_mac")
        clock.advance(1.0)
        log.note("unsigned")
        log.note("corrupt")  # held back: one report scheduled for the period's end
        assert len(clock.scheduled) == 1
        assert [r.getMessage() for r in caplog.records] == ["refused: 1 bad_mac"]
        clock.advance(8.5)
        assert len(caplog.records) == 1
        clock.advance(0.5)  # the period is over; no event came
    assert [r.getMessage() for r in caplog.records] == [
        "refused: 1 bad_mac",
        "refused: 1 corrupt, 1 unsigned",
    ]
    assert clock.scheduled == []


def test_counters_keep_totals_and_hand_out_intervals_across_threads() -> None:
    counts = Counters()

    def add_many() -> None:
        for _ in range(500):
            counts.add(hits=1, misses=0)

    threads = [threading.Thread(target=add_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts.take() == {"hits": 2000}  # a zero delta creates no counter
    counts.add(hits=1)
    assert counts.take() == {"hits": 1}
    assert counts.take() == {}
    assert counts.totals() == {"hits": 2001}
