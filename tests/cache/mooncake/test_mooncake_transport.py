"""The Mooncake transport's lanes on their own: which lane a transfer goes to, and skips."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from mmkey._deadline import Done
from mmkey.cache.mooncake._transport import TRANSFER_LANES, StoreTransport
from mmkey.cache.mooncake.config import MooncakeConfig
from tests._clock import FakeClock


class NeverSetUp:
    """A store class the transport never instantiates here (no connect)."""


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def transport(clock: FakeClock) -> Iterator[StoreTransport]:
    config = MooncakeConfig(master_server_address="127.0.0.1:9", timeout=0.2)
    t = StoreTransport(config, NeverSetUp, lambda: None, lambda: None, clock)  # type: ignore[arg-type]
    yield t
    t.close()


def occupy(transport: StoreTransport, index: int, release: threading.Event) -> threading.Event:
    started = threading.Event()

    def hold() -> None:
        started.set()
        release.wait(10)

    transport.lanes[index].worker.submit(hold)
    assert started.wait(5)
    return started


def test_idle_lanes_first_then_queue_behind_a_healthy_one_then_none(
    transport: StoreTransport, clock: FakeClock
) -> None:
    assert TRANSFER_LANES >= 2
    release = threading.Event()
    try:
        taken: set[int] = set()
        first = transport.pick_lane(taken)
        assert first is transport.lanes[0] and taken == {0}
        occupy(transport, 0, release)
        assert transport.pick_lane(set()) is transport.lanes[1], "an idle lane before a busy one"
        for i in range(1, TRANSFER_LANES):
            occupy(transport, i, release)
        busy = transport.pick_lane(set())
        assert busy is transport.lanes[0], "every lane busy but within its timeout: queue behind one"
        assert transport.pick_lane(set()) is transport.lanes[0], "still within the timeout, by the clock"
        clock.advance(0.3)  # past the timeout: every lane is stuck now
        assert transport.pick_lane(set()) is None
        assert transport.busy_lanes() == TRANSFER_LANES
    finally:
        release.set()
    for lane in transport.lanes:
        assert isinstance(lane.worker.run(lambda: None, transport.clock() + 5), Done)
    assert transport.busy_lanes() == 0


def test_distinct_lanes_within_one_round(transport: StoreTransport) -> None:
    taken: set[int] = set()
    lanes = [transport.pick_lane(taken) for _ in range(TRANSFER_LANES)]
    assert len({id(lane) for lane in lanes}) == TRANSFER_LANES
    assert transport.pick_lane(taken) is None, "one transfer per lane in a round"


def test_skips_are_logged_at_most_once_per_period(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from mmkey._log import RateLimitedLog

    log = RateLimitedLog(
        logging.getLogger("mmkey.cache.mooncake"),
        logging.WARNING,
        "Mooncake calls answered as misses without the store: %s%s",
        period=10.0,
    )
    with caplog.at_level("WARNING", logger="mmkey.cache.mooncake"):
        for _ in range(50):
            log.note("holder quarantined")
        log.note("every transfer lane stuck")
    records = [r for r in caplog.records if "without the store" in r.getMessage()]
    assert len(records) == 1 and "1 holder quarantined" in records[0].getMessage()
