"""A pytest plugin for ``scripts/mutate.py --select``: which tests run each line of some modules.

Loaded with ``-p _lines_by_test`` (``scripts/`` on ``sys.path``); the modules to watch are named
by ``MMKEY_LINES_WATCH`` (paths, ``os.pathsep`` between them) and the map is written as JSON to
``MMKEY_LINES_OUT``: ``{path: {line: [test ids, in run order]}}``, where ``"<import>"`` stands
for lines run outside any test (module bodies at import, fixtures of a wider scope), and under
``DURATIONS`` the seconds each test took (its set-up, call and tear-down).
Only this process's threads are traced; lines run in a child process are not seen.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

_WATCHED = {str(Path(p).resolve()) for p in os.environ.get("MMKEY_LINES_WATCH", "").split(os.pathsep) if p}
_SEEN: dict[str, dict[int, list[str]]] = {path: {} for path in _WATCHED}
_current = ["<import>"]
DURATIONS = "<durations>"
_took: dict[str, float] = {}

_Tracer = Callable[[FrameType, str, Any], Any]


def _local(frame: FrameType, event: str, arg: object) -> _Tracer:
    if event == "line":
        tests = _SEEN[frame.f_code.co_filename].setdefault(frame.f_lineno, [])
        if not tests or tests[-1] != _current[0]:
            tests.append(_current[0])
    return _local


def _global(frame: FrameType, event: str, arg: object) -> _Tracer | None:
    if frame.f_code.co_filename in _WATCHED:
        _local(frame, "line", arg)  # the def line itself (a call's first line event is later)
        return _local
    return None


sys.settrace(_global)
threading.settrace(_global)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    _current[0] = item.nodeid
    try:
        return (yield)
    finally:
        _current[0] = "<import>"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("MMKEY_LINES_OUT")
    if out:
        Path(out).write_text(json.dumps({**_SEEN, DURATIONS: _took}))
