"""Markers of the Mooncake client's tests: the ones that must not be crowded are `serial`.

`test_mooncake_load.py` loads the whole host on purpose (`mmkey.testing.busy_host`, staging up
to 1 GiB), the fleet tests' holders must keep their heartbeats to the master while one of them
is paused (on a host crowded at the same priority a healthy holder's segment was dropped too),
and the single-flight fleet tests time waits across processes. `make test` runs them after the
parallel pass, at normal CPU priority while the other lane runs niced, so that lane only gets
the CPU these tests leave."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._marks import mark_modules

_SERIAL_MODULES = frozenset(
    {"test_mooncake_load.py", "test_mooncake_fleet.py", "test_single_flight_fleet.py"}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_modules(items, Path(__file__).parent, pytest.mark.serial, _SERIAL_MODULES)
