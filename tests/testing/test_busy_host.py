"""`busy_host`: its load processes run inside the block and are gone after it."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from mmkey.testing import busy_host as module
from mmkey.testing.busy_host import busy_host


def _children() -> list[psutil.Process]:
    return psutil.Process().children()


def test_the_block_runs_with_both_load_processes_running_and_leaves_none(tmp_path: Path) -> None:
    before = {p.pid for p in _children()}
    with busy_host(30.0, memory_bytes=1 << 20, write_bytes=4096, directory=str(tmp_path)):
        assert len(list(tmp_path.glob("mmkey-busy-*/load"))) == 1  # the writer has begun
        loads = [p for p in _children() if p.pid not in before]
        assert len(loads) == 2
        assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in loads)
    assert not any(p.is_running() for p in loads)
    assert list(tmp_path.iterdir()) == []


def test_a_load_process_that_never_starts_is_an_error_and_leaves_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(module, "_FILE_LOAD", "import sys; sys.exit(3)")
    before = {p.pid for p in _children()}
    with pytest.raises(RuntimeError, match="did not start"), busy_host(30.0, memory_bytes=1 << 20):
        pass
    assert {p.pid for p in _children()} <= before
