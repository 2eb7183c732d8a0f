"""No test lets real time pass by sleeping, but the few marked `realtime`.

The logic and fault tests run on an injected clock (`tests._clock.FakeClock`) and advance it;
the tests marked ``@pytest.mark.realtime`` measure real time against a real master and keep
the timing promises honest. This check reads every module under ``tests/`` with `ast` and
fails on a ``time.sleep`` call (or an ``asyncio.sleep`` of anything but a literal 0) outside a
function, class or module marked `realtime` and outside the helper files of `ALLOWED`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

ALLOWED: dict[str, str] = {
    "_support.py": "`wait_until` polls the state of a real process or thread between its tries",
    "cache/mooncake/single_flight_worker.py": (
        "a worker process of the single-flight fleet: its encode takes real time, as a real "
        "encoder's does, while other processes wait on its claim; it waits for the start file "
        "another process writes"
    ),
    "integrations/vllm/vllm_engine_run.py": (
        "runs a vLLM engine in a process of its own: it waits for files that other processes "
        "write (the pause, the producer's parameters, the barrier)"
    ),
}
"""Helper files (relative to ``tests/``) that may sleep, each with the reason."""


def _is_realtime_mark(node: ast.expr) -> bool:
    """Whether `node` is ``pytest.mark.realtime`` (or ``mark.realtime``, called or not)."""
    if isinstance(node, ast.Call):
        node = node.func
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "realtime"
        and isinstance(node.value, ast.Attribute | ast.Name)
        and (node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id) == "mark"
    )


def _module_is_realtime(tree: ast.Module) -> bool:
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "pytestmark" for target in statement.targets
        ):
            value = statement.value
            marks = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
            if any(_is_realtime_mark(mark) for mark in marks):
                return True
    return False


class _Sleeps(ast.NodeVisitor):
    """The lines of the sleep calls outside anything marked `realtime`."""

    def __init__(self) -> None:
        self.found: list[int] = []
        self._realtime = 0  # how many enclosing definitions are marked realtime
        self._time_names = {"time"}  # names the time module is bound to
        self._asyncio_names = {"asyncio"}
        self._time_sleeps: set[str] = set()  # `from time import sleep [as name]`
        self._asyncio_sleeps: set[str] = set()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "time":
                self._time_names.add(alias.asname or "time")
            elif alias.name == "asyncio":
                self._asyncio_names.add(alias.asname or "asyncio")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name == "sleep" and node.module == "time":
                self._time_sleeps.add(alias.asname or "sleep")
            elif alias.name == "sleep" and node.module == "asyncio":
                self._asyncio_sleeps.add(alias.asname or "sleep")

    def _definition(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        marked = any(_is_realtime_mark(d) for d in node.decorator_list)
        self._realtime += marked
        self.generic_visit(node)
        self._realtime -= marked

    visit_FunctionDef = _definition
    visit_AsyncFunctionDef = _definition
    visit_ClassDef = _definition

    def visit_Call(self, node: ast.Call) -> None:
        if not self._realtime and self._sleeps(node):
            self.found.append(node.lineno)
        self.generic_visit(node)

    def _sleeps(self, node: ast.Call) -> bool:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "sleep" and isinstance(func.value, ast.Name):
            if func.value.id in self._time_names:
                return True
            if func.value.id in self._asyncio_names:
                return not _is_zero(node)
        if isinstance(func, ast.Name):
            if func.id in self._time_sleeps:
                return True
            if func.id in self._asyncio_sleeps:
                return not _is_zero(node)
        return False


def _is_zero(call: ast.Call) -> bool:
    """Whether an ``asyncio.sleep`` call only yields to the loop (``sleep(0)``)."""
    arg = call.args[0] if call.args else None
    return isinstance(arg, ast.Constant) and arg.value == 0 and not isinstance(arg.value, bool)


def sleeps_outside_realtime(source: str) -> list[int]:
    """The lines of `source` that sleep outside a definition (or module) marked `realtime`."""
    tree = ast.parse(source)
    if _module_is_realtime(tree):
        return []
    visitor = _Sleeps()
    visitor.visit(tree)
    return sorted(visitor.found)


def test_no_test_sleeps_outside_the_realtime_tests_and_the_listed_helpers() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        name = path.relative_to(TESTS).as_posix()
        if name in ALLOWED:
            continue
        found += [f"tests/{name}:{line}" for line in sleeps_outside_realtime(path.read_text())]
    assert found == [], (
        "sleeps outside the tests marked @pytest.mark.realtime: advance an injected clock "
        "(tests._clock.FakeClock) or poll with tests._support.wait_until instead: " + ", ".join(found)
    )


def test_each_allowed_helper_exists_and_still_sleeps() -> None:
    for name, reason in ALLOWED.items():
        path = TESTS / name
        assert path.is_file() and reason, name
        assert sleeps_outside_realtime(path.read_text()), f"{name} sleeps no more: take it off ALLOWED"


SNIPPET = """\
import asyncio
import time
import time as wall
from time import sleep as nap

import pytest


def test_plain():
    time.sleep(0.1)  # line 10


def helper():
    wall.sleep(1)  # line 14
    nap(1)  # line 15


async def test_async():
    await asyncio.sleep(0)
    await asyncio.sleep(0.05)  # line 20


@pytest.mark.realtime
def test_real():
    time.sleep(0.1)

    def inner():
        time.sleep(0.1)


@pytest.mark.realtime
class TestReal:
    def test_one(self):
        time.sleep(0.1)


class TestPlain:
    @pytest.mark.realtime
    def test_real(self):
        time.sleep(0.1)

    def test_plain(self):
        time.sleep(0.1)  # line 43
"""


def test_the_check_finds_the_sleeps_of_a_snippet() -> None:
    assert sleeps_outside_realtime(SNIPPET) == [10, 14, 15, 20, 43]


@pytest.mark.parametrize("mark", ["pytest.mark.realtime", "[pytest.mark.mooncake, pytest.mark.realtime]"])
def test_a_module_marked_realtime_may_sleep(mark: str) -> None:
    assert sleeps_outside_realtime(f"import pytest\nimport time\npytestmark = {mark}\ntime.sleep(1)\n") == []


def test_a_module_marked_otherwise_may_not() -> None:
    source = "import pytest\nimport time\npytestmark = pytest.mark.slow\ntime.sleep(1)\n"
    assert sleeps_outside_realtime(source) == [4]
