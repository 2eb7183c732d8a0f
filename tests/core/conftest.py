"""Markers of the core tests: the modules that start fresh interpreters are `slow`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._marks import mark_modules

# each test starts Python processes (fresh interpreters, torch blocked, another hash seed), so
# they are left out of `make check`, the quick loop
_PROCESS_MODULES = frozenset({"test_process_independence.py", "test_without_torch.py", "test_import_cost.py"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_modules(items, Path(__file__).parent, pytest.mark.slow, _PROCESS_MODULES)
