"""Holder quarantine on its own, with a fake clock."""

from __future__ import annotations

import pytest

from mmkey.cache.mooncake._quarantine import Quarantine


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_add_holds_and_lift() -> None:
    q = Quarantine(retry_after=1.0, clock=FakeClock())
    assert not q and q.endpoints() == ()
    assert q.add("10.0.0.2:15000", ["k1", "k2"])
    assert not q.add("10.0.0.2:15000", ["k3"]), "already held"
    assert q.add("10.0.0.1:15000", ["k9"])
    assert q and q.holds("10.0.0.2:15000") and not q.holds("10.0.0.3:15000")
    assert q.endpoints() == ("10.0.0.1:15000", "10.0.0.2:15000")
    q.lift("10.0.0.2:15000")
    q.lift("10.0.0.2:15000")  # idempotent
    assert q.endpoints() == ("10.0.0.1:15000",)


def test_one_probe_per_holder_per_period_and_none_while_one_runs() -> None:
    clock = FakeClock()
    q = Quarantine(retry_after=1.0, clock=clock)
    q.add("h:1", ["a", "b", "c", "d"])
    assert q.due_probes() == [], "just quarantined: wait a period first"
    clock.now += 1.0
    assert q.due_probes() == [("h:1", ["a", "b", "c"])]
    clock.now += 5.0
    assert q.due_probes() == [], "the probe still runs (a stuck transfer)"
    q.probed("h:1", healthy=False)
    assert q.holds("h:1") and q.due_probes() == []
    clock.now += 1.0
    assert [endpoint for endpoint, _ in q.due_probes()] == ["h:1"]
    q.probed("h:1", healthy=True)
    assert not q.holds("h:1") and q.due_probes() == []
    q.probed("h:1", healthy=False)  # a late report about a lifted holder changes nothing
    assert not q


def test_probe_keys_prefer_the_latest_failures() -> None:
    clock = FakeClock()
    q = Quarantine(retry_after=1.0, clock=clock)
    q.add("h:1", ["old1", "old2", "old3"])
    q.add("h:1", ["new"])
    clock.now += 1.0
    assert q.due_probes() == [("h:1", ["new", "old1", "old2"])]


def test_a_late_answer_lifts_the_holder_and_outranks_failures_of_transfers_started_before_it() -> None:
    clock = FakeClock()
    q = Quarantine(retry_after=1.0, clock=clock)
    assert not q.answered("h:1"), "nothing held"
    clock.now += 1.0
    started = clock.now
    clock.now += 0.5
    assert q.add("h:1", ["a"], since=started)
    clock.now += 0.1
    assert q.answered("h:1"), "the transfer that timed out completed: re-admitted at once"
    assert not q.holds("h:1")
    # a failure of a transfer started before that answer does not quarantine it again...
    assert not q.add("h:1", ["b"], since=started)
    assert not q.add("h:1", ["b"], since=clock.now)
    assert not q
    # ...one started after it does, as does a failure that says nothing of when it started
    clock.now += 0.1
    assert q.add("h:1", ["c"], since=clock.now)
    q.lift("h:1")
    assert q.add("h:1", ["d"])
    assert q.add("h:2", ["e"], since=started), "another holder's late answer is its own"


def test_each_failed_probe_doubles_the_wait_before_the_next_up_to_longest() -> None:
    clock = FakeClock()
    q = Quarantine(retry_after=1.0, clock=clock, longest=4.0)
    q.add("h:1", ["a"])
    for wait in (1.0, 2.0, 4.0, 4.0):  # a hung holder: every probe fails
        clock.now += wait - 0.01
        assert q.due_probes() == [], f"probed before its wait of {wait} s"
        clock.now += 0.01
        assert [endpoint for endpoint, _ in q.due_probes()] == ["h:1"]
        q.probed("h:1", healthy=False)
    assert q.holds("h:1")
    clock.now += 4.0
    assert q.due_probes() != []
    q.probed("h:1", healthy=True)
    assert not q.holds("h:1")
    q.add("h:1", ["b"])  # held again later: the wait starts over
    clock.now += 1.0
    assert [endpoint for endpoint, _ in q.due_probes()] == ["h:1"]


def test_longest_below_retry_after_is_refused() -> None:
    with pytest.raises(ValueError, match="at least retry_after"):
        Quarantine(retry_after=2.0, clock=FakeClock(), longest=1.0)


def test_without_longest_the_probes_keep_their_period() -> None:
    clock = FakeClock()
    q = Quarantine(retry_after=1.0, clock=clock)
    q.add("h:1", ["a"])
    for _ in range(3):
        clock.now += 1.0
        assert q.due_probes() != []
        q.probed("h:1", healthy=False)
