"""A small mutation test: apply one mutation at a time to a copy of ``src/``, run the tests
that cover it, and report the mutants no test kills (survivors).

Mutations: a comparison flipped (``==``/``!=``, ``<``/``>=``, ``<=``/``>``, ``in``/``not in``,
``is``/``is not``), ``and``/``or`` swapped, ``not`` dropped, an int constant off by one, a
``raise`` dropped (the check it makes is gone) and a ``True``/``False`` flipped. Slow (one
test run per mutant), so not part of ``make test``; run it by hand, e.g.::

    PYTHONPATH= HYPOTHESIS_PROFILE=quick .venv/bin/python scripts/mutate.py \\
        src/mmkey/entry/_format.py --tests tests/entry

``--every N`` samples one mutant in N, ``--start`` skips the first ones, ``--only`` tries the
ones named by their ``#``, ``--list`` only prints the mutants, ``--python`` runs the tests with
another interpreter (a stack's environment, e.g. ``.venv-sglang/bin/python``; by default this
one). ``--select`` first runs the tests once with ``scripts/_lines_by_test.py`` to learn which
tests run each line, then runs only those for a mutant on it (all of them for a line run at
import or by no test: a child process's lines are not traced). Exit status 1 when a mutant
survives.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent

_FLIPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.LtE: ast.Gt,
    ast.Gt: ast.LtE,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}


def _in_overloads(tree: ast.Module) -> set[int]:
    """The ids of the nodes of ``@overload`` stubs (no run-time effect: never mutated)."""
    stubs = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef)
        and any(ast.unparse(d).endswith("overload") for d in n.decorator_list)
    ]
    return {id(node) for stub in stubs for node in ast.walk(stub)}


def _sites(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """Every place a mutation applies, with what it does (in a stable order)."""
    skipped = _in_overloads(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Compare):
            for op in node.ops:
                if type(op) in _FLIPS:
                    yield node, f"{type(op).__name__} -> {_FLIPS[type(op)].__name__}"
        elif isinstance(node, ast.BoolOp):
            yield node, "and <-> or"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node, "drop not"
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            yield node, f"{node.value} -> {node.value + 1}"
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            yield node, f"{node.value} -> {not node.value}"
        elif isinstance(node, ast.Raise):
            yield node, "drop raise"


class _Mutate(ast.NodeTransformer):
    """Applies the mutation `what` at the node `target` (one of `_sites`)."""

    def __init__(self, target: ast.AST, what: str) -> None:
        self.target, self.what = target, what

    def visit(self, node: ast.AST) -> ast.AST:
        if node is not self.target:
            visited: ast.AST = super().visit(node)
            return visited
        if isinstance(node, ast.Compare):
            old = self.what.split(" -> ")[0]
            for i, op in enumerate(node.ops):
                if type(op).__name__ == old:
                    node.ops[i] = _FLIPS[type(op)]()
                    break
            return node
        if isinstance(node, ast.BoolOp):
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            return node
        if isinstance(node, ast.UnaryOp):
            return node.operand
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool):
                node.value = not value
            elif isinstance(value, int):
                node.value = value + 1
            return node
        if isinstance(node, ast.Raise):
            return ast.Pass()
        return node


def mutants(path: Path) -> list[tuple[int, str]]:
    """``(line, what)`` of each mutant of the module at `path`."""
    tree = ast.parse(path.read_text())
    return [(getattr(node, "lineno", 0), what) for node, what in _sites(tree)]


def spans(path: Path) -> list[range]:
    """The lines each mutant of the module at `path` spans."""
    tree = ast.parse(path.read_text())
    found = []
    for node, _ in _sites(tree):
        first: int = getattr(node, "lineno", 0)
        last: int | None = getattr(node, "end_lineno", None)
        found.append(range(first, (last or first) + 1))
    return found


def mutated(path: Path, index: int) -> str:
    """The source of `path` with mutant `index` applied."""
    tree = ast.parse(path.read_text())
    node, what = list(_sites(tree))[index]
    changed = _Mutate(node, what).visit(tree)
    return ast.unparse(ast.fix_missing_locations(changed))


Lines = dict[str, dict[str, Any]]
"""Module path -> line -> the tests that ran it; ``"<durations>"`` -> test -> seconds."""


def run_tests(
    src: Path,
    tests: list[str],
    timeout: float,
    python: str = sys.executable,
    trace: tuple[list[Path], Path] | None = None,
) -> bool | None:
    """Whether the tests pass against the source tree `src`, run by the interpreter `python`
    (``None``: they ran past `timeout`, a hang or only slow); with `trace` (modules, out), the
    map of which tests ran each line of them is written to out."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPYCACHEPREFIX", None)
    plugin: list[str] = []
    if trace is not None:
        watched, out = trace
        env["PYTHONPATH"] += os.pathsep + str(ROOT / "scripts")
        env["MMKEY_LINES_WATCH"] = os.pathsep.join(map(str, watched))
        env["MMKEY_LINES_OUT"] = str(out)
        plugin = ["-p", "_lines_by_test"]
    command = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *plugin, *tests]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        _last_output[:] = [f"timed out after {timeout} s"]
        return None
    _last_output[:] = [done.stdout.decode(errors="replace")[-3000:]]
    return done.returncode == 0


_last_output: list[str] = []
"""The end of the last test run's output (shown when the tests fail without a mutant)."""


def _relative(path: str, src: Path) -> str:
    """A traced module's path relative to the copy of ``src/`` (the durations' key as it is)."""
    return path if path == "<durations>" else str(Path(path).relative_to(src))


def covering(
    lines: dict[str, list[str]], span: range, every: list[str], took: dict[str, float] | None = None
) -> list[str]:
    """The tests to run for a mutant on the lines `span`: those that ran them, quickest first
    by `took` (seconds each test took in the traced run; else in run order), or `every` test
    when one of the lines ran outside a test or no test ran them."""
    ran = [test for line in span for test in lines.get(str(line), [])]
    if not ran or "<import>" in ran:
        return every
    unique = list(dict.fromkeys(ran))
    return unique if took is None else sorted(unique, key=lambda test: took.get(test, 0.0))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("modules", nargs="+", type=Path, help="files under src/ to mutate")
    parser.add_argument("--tests", nargs="+", default=["tests/entry"], help="what pytest runs")
    parser.add_argument("--every", type=int, default=1, help="try one mutant in N")
    parser.add_argument("--start", type=int, default=0, help="skip the first mutants")
    parser.add_argument("--only", type=int, nargs="+", help="try only these mutants (by #)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per test run (10 times it for the first)"
    )
    parser.add_argument("--list", action="store_true", help="print the mutants and stop")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the tests")
    parser.add_argument("--select", action="store_true", help="run only the tests that run a mutant's lines")
    parser.add_argument(
        "--lines",
        type=Path,
        help="with --select: the map of which tests run each line, read from this file if it "
        "exists (no traced run), else written to it (to reuse for more modules under the same --tests)",
    )
    args = parser.parse_args()
    survivors: list[str] = []
    slow: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mmkey-mutate-") as scratch:
        copy = Path(scratch) / "src"
        shutil.copytree(ROOT / "src", copy, ignore=shutil.ignore_patterns("__pycache__"))
        inside_of = {m: copy / m.resolve().relative_to(ROOT / "src") for m in args.modules}
        lines: Lines = {}
        if args.select and args.lines is not None and args.lines.exists():
            lines = json.loads(args.lines.read_text())  # keys: module paths relative to src/
        elif not args.list:
            traced = Path(scratch) / "lines.json"
            # every module of the mutated modules' packages, so that --lines serves their siblings too
            watched = sorted({py for inside in inside_of.values() for py in inside.parent.glob("*.py")})
            trace = (watched, traced) if args.select else None
            # the first run, traced or not, may take longer than a mutant's (a tracer slows it)
            if not run_tests(copy, args.tests, 10 * args.timeout, args.python, trace):
                failed = "the tests fail without a mutant: fix them first"
                print(failed, *_last_output, sep="\n", file=sys.stderr)
                return 2
            if args.select:
                seen: Lines = json.loads(traced.read_text())
                lines = {_relative(k, copy): v for k, v in seen.items()}
                if args.lines is not None:
                    args.lines.write_text(json.dumps(lines))
        for module in args.modules:
            inside = inside_of[module]  # the copy, made at the start: edits of src/ meanwhile are not seen
            original = inside.read_text()
            found, lines_of = mutants(inside), spans(inside)
            chosen = args.only or range(args.start, len(found), args.every)
            for index in chosen:
                line, what = found[index]
                name = f"{module}:{line} #{index} {what}"
                if args.list:
                    print(name)
                    continue
                tests = args.tests
                if args.select:
                    ran = lines.get(str(inside.relative_to(copy)), {})
                    took = cast("dict[str, float] | None", lines.get("<durations>"))
                    tests = covering(ran, lines_of[index], args.tests, took)
                    name += " [all]" if tests is args.tests else f" [{len(tests)} tests]"
                inside.write_text(mutated(inside, index))
                started = time.monotonic()
                try:
                    passed = run_tests(copy, tests, args.timeout, args.python)
                finally:
                    inside.write_text(original)
                killed, timed_out = passed is not True, passed is None  # a hang counts as killed
                verdict = "timeout" if timed_out else "killed" if killed else "SURVIVED"
                print(f"{verdict:8} {name} ({time.monotonic() - started:.0f} s)", flush=True)
                if not killed:
                    survivors.append(name)
                elif timed_out:
                    slow.append(name)
    if survivors:
        print(f"\n{len(survivors)} survivor(s):", *survivors, sep="\n  ")
    if slow:
        print(f"\n{len(slow)} timed out (a hang, or only slow: rerun with --only and a longer --timeout):")
        print(*slow, sep="\n  ")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
