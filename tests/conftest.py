"""Shared test configuration: hypothesis profiles."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# mmkey's pytest plugin (the `mooncake_master` fixtures). An installed mmkey registers it via
# its `pytest11` entry point under the name "mmkey"; registering the same module again would be
# an error, so load it here only when neither name is registered nor "-p no:mmkey" was given.
_MMKEY_PLUGIN = "mmkey.testing.pytest_plugin"


def pytest_configure(config: pytest.Config) -> None:
    manager = config.pluginmanager
    if manager.is_blocked("mmkey") or manager.has_plugin("mmkey") or manager.has_plugin(_MMKEY_PLUGIN):
        return
    manager.import_plugin(_MMKEY_PLUGIN)


@pytest.fixture(autouse=True)
def _forget_the_entry_secret_taken_from_the_environment() -> object:
    """A secret read from ``MMKEY_ENTRY_KEY`` stays with the process once the variable is
    removed; each test starts without one."""
    yield
    from mmkey.cache import auth

    auth._forget_taken_secret()
