"""Markers that a folder's conftest gives to its own modules, chosen by file name."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import pytest


def mark_modules(
    items: list[pytest.Item],
    folder: Path,
    marker: pytest.MarkDecorator,
    modules: Collection[str] | None = None,
) -> None:
    """Give `marker` to the tests of the modules in `folder`: those named in `modules`, or all.

    pytest calls each conftest's ``pytest_collection_modifyitems`` with the items of the whole
    session, so each folder picks out its own."""
    for item in items:
        if item.path.parent == folder and (modules is None or item.path.name in modules):
            item.add_marker(marker)
