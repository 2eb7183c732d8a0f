"""Markers of the project's own checks: those that run the examples or the type checkers in
processes of their own are `slow`, so left out of `make check`, the quick loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._marks import mark_modules

_PROCESS_MODULES = frozenset({"test_example_server.py", "test_quickstart.py", "test_typing_harness.py"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_modules(items, Path(__file__).parent, pytest.mark.slow, _PROCESS_MODULES)
