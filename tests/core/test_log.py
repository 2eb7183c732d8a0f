"""The rate-limited log and the counters that the Mooncake client and both integrations share."""

from __future__ import annotations

import logging
import threading

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


def test_notes_are_summed_by_reason_into_one_line_a_period(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(_LOGGER, logging.WARNING, "skipped: %s%s", period=10.0)
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
