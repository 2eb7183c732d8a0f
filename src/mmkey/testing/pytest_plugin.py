"""pytest plugin of mmkey: fixtures that run a real local Mooncake master (and fleet).

``mooncake_master`` gives each test a fresh master (pause, kill and restart it freely);
``mooncake_master_session`` shares one for the whole session (leave it running);
``mooncake_fleet`` runs a master with two segment-holder processes and
``mooncake_fleet_netns`` puts each holder in a network namespace of its own. All skip
the test, naming what to install, when the binding or the binary is missing; set
``MMKEY_REQUIRE_MOONCAKE=1`` to fail instead (for CI jobs that must run them).
Registered through the ``pytest11`` entry point; importing it loads neither mooncake nor
hypothesis.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from mmkey.testing.fleet import Fleet
    from mmkey.testing.mooncake_master import MasterProcess

__all__ = ["mooncake_fleet", "mooncake_fleet_netns", "mooncake_master", "mooncake_master_session"]

REQUIRE_ENV = "MMKEY_REQUIRE_MOONCAKE"


def pytest_configure(config: pytest.Config) -> None:
    """Declare the ``mooncake`` marker so suites using ``--strict-markers`` accept it."""
    config.addinivalue_line("markers", "mooncake: needs the Mooncake binding and a local mooncake_master")


def _unless(reason: str | None) -> None:
    """Skip the test for ``reason`` (a failure when ``MMKEY_REQUIRE_MOONCAKE`` is set)."""
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"{REQUIRE_ENV} is set but {reason}", pytrace=False)
    pytest.skip(reason)


def _missing_harness_reason() -> str | None:
    """Why the harness cannot run here for want of psutil, or ``None`` when it is installed."""
    if importlib.util.find_spec("psutil") is None:
        return "psutil is not installed (the master and fleet harness needs it); pip install 'mmkey[testing]'"
    return None


def _require_master() -> None:
    _unless(_missing_harness_reason())
    from mmkey.testing.mooncake_master import master_unavailable_reason

    _unless(master_unavailable_reason())


@pytest.fixture
def mooncake_master() -> Iterator[MasterProcess]:
    """A fresh local master for one test, stopped (and reaped) afterwards."""
    _require_master()
    from mmkey.testing.mooncake_master import running_master

    with running_master() as master:
        yield master


@pytest.fixture(scope="session")
def mooncake_master_session() -> Iterator[MasterProcess]:
    """One local master shared by the session: do not pause, kill or restart it."""
    _require_master()
    from mmkey.testing.mooncake_master import running_master

    with running_master() as master:
        yield master


def _require_fleet() -> None:
    _unless(_missing_harness_reason())
    from mmkey.testing.fleet import fleet_unavailable_reason

    _unless(fleet_unavailable_reason())


@pytest.fixture
def mooncake_fleet() -> Iterator[Fleet]:
    """A fresh master with two segment-holder processes on loopback, for one test.

    Pause, kill and restart holders freely; everything is stopped afterwards.
    """
    _require_fleet()
    from mmkey.testing.fleet import running_fleet

    with running_fleet(2) as fleet:
        yield fleet


@pytest.fixture
def mooncake_fleet_netns() -> Iterator[Fleet]:
    """Like ``mooncake_fleet``, with each holder in a network namespace of its own, so that
    partitions and shaping work; skips with the reason where namespaces are unavailable."""
    _require_fleet()
    from mmkey.testing.fleet import netns_unavailable_reason, running_fleet

    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with running_fleet(2, netns=True) as fleet:
        yield fleet
