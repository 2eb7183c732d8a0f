"""Markers of the command line's tests: each starts Python processes (the `mmkey` command, the
demo, a holder), so all of them are `slow` and left out of `make check`, the quick loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._marks import mark_modules


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_modules(items, Path(__file__).parent, pytest.mark.slow)
