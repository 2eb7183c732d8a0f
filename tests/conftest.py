"""The suite's configuration: hypothesis profiles, markers, and a prompt exit.

Each folder mirrors a package of mmkey; its own conftest marks its modules (`slow` ones that
start processes, `serial` ones that must not be crowded). Here: what every folder shares."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

from tests._hypothesis_profiles import profile_for, register_profiles

register_profiles()
settings.load_profile(profile_for(os.environ))


# mmkey's pytest plugin (the `mooncake_master` fixtures). An installed mmkey registers it via
# its `pytest11` entry point under the name "mmkey"; registering the same module again would be
# an error, so load it here only when neither name is registered nor "-p no:mmkey" was given.
_MMKEY_PLUGIN = "mmkey.testing.pytest_plugin"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "serial: must not be crowded: `make test` runs it at normal priority, the rest niced"
    )
    manager = config.pluginmanager
    if manager.is_blocked("mmkey") or manager.has_plugin("mmkey") or manager.has_plugin(_MMKEY_PLUGIN):
        return
    manager.import_plugin(_MMKEY_PLUGIN)


@pytest.fixture(autouse=True)
def _forget_the_entry_secret_taken_from_the_environment() -> object:
    """A secret read from ``MMKEY_ENTRY_KEY`` stays with the process once the variable is
    removed; each test starts without one."""
    yield
    from mmkey.entry import auth

    auth._forget_taken_secret()


# Tests that start a Mooncake master or holders themselves (through a fixture), in any folder;
# they are left out of `make check`, the quick loop, with the tests marked `mooncake` by hand.
_STORE_FIXTURES = frozenset(
    {"mooncake_master", "mooncake_master_session", "mooncake_fleet", "mooncake_fleet_netns"}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _STORE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.mooncake)


# Mooncake's client threads keep reconnecting to the masters the tests stopped, and the
# binding's exit waits for them (about 20 s after a suite of store tests). The test process
# has nothing left to do once pytest is done with the session, so it leaves at once with
# pytest's own exit status. This is the suite's choice, not the public plugin's: a user's
# suite may have its own exit work.
_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if "mooncake.store" not in sys.modules or hasattr(config, "workerinput"):
        return  # nothing to wait for; xdist workers leave on their own once they report
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
