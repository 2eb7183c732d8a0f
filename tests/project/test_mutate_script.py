"""scripts/mutate.py's choice of tests for a mutant and its mutations (no test run)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
mutate: Any = importlib.import_module("mutate")

EVERY = ["tests/a", "tests/b"]


def test_a_mutant_runs_the_tests_that_ran_its_lines_quickest_first() -> None:
    lines = {"3": ["t::slow", "t::quick"], "4": ["t::quick", "t::other"]}
    assert mutate.covering(lines, range(3, 5), EVERY) == ["t::slow", "t::quick", "t::other"]
    took = {"t::slow": 9.0, "t::quick": 0.1, "t::other": 1.0}
    assert mutate.covering(lines, range(3, 5), EVERY, took) == ["t::quick", "t::other", "t::slow"]


def test_a_line_run_at_import_or_by_no_test_runs_every_test() -> None:
    lines = {"3": ["<import>", "t::x"], "4": ["t::y"]}
    assert mutate.covering(lines, range(3, 4), EVERY) is EVERY
    assert mutate.covering(lines, range(9, 11), EVERY) is EVERY
    assert mutate.covering(lines, range(4, 5), EVERY) == ["t::y"]


def test_each_mutation_applies_where_it_is_listed(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f(a, b):\n    if a < b and not a:\n        raise ValueError\n    return 1\n")
    found = mutate.mutants(module)
    assert found == [(2, "and <-> or"), (3, "drop raise"), (4, "1 -> 2"), (2, "Lt -> GtE"), (2, "drop not")]
    assert mutate.spans(module) == [range(2, 3), range(3, 4), range(4, 5), range(2, 3), range(2, 3)]
    assert "a < b or not a" in mutate.mutated(module, 0)
    assert "raise" not in mutate.mutated(module, 1)
    assert "return 2" in mutate.mutated(module, 2)
    assert "a >= b" in mutate.mutated(module, 3) and "a < b" not in mutate.mutated(module, 3)
    assert "and a:" in mutate.mutated(module, 4)
