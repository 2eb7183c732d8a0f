"""The source tree stays easy to find one's way in: every module's file name is its own (a path
is never the only way to tell two apart) and no module grows past 600 lines."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "mmkey"
MAX_LINES = 600
SHARED_NAMES = {"__init__.py", "__main__.py"}


def duplicate_names(root: Path) -> dict[str, list[str]]:
    """File names that more than one module under ``root`` has (package files excepted)."""
    paths = sorted(root.rglob("*.py"))
    counts = Counter(p.name for p in paths if p.name not in SHARED_NAMES)
    return {
        name: sorted(p.relative_to(root).as_posix() for p in paths if p.name == name)
        for name, n in counts.items()
        if n > 1
    }


def long_modules(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Modules under ``root`` of more than ``limit`` lines, with their length."""
    paths = sorted(root.rglob("*.py"))
    lengths = {p.relative_to(root).as_posix(): len(p.read_text(encoding="utf-8").splitlines()) for p in paths}
    return {name: n for name, n in lengths.items() if n > limit}


def test_the_tree_is_found() -> None:
    assert len(list(SRC.rglob("*.py"))) > 50


def test_every_module_file_name_is_its_own() -> None:
    assert duplicate_names(SRC) == {}


def test_no_module_is_over_600_lines() -> None:
    assert long_modules(SRC) == {}


@pytest.mark.parametrize("name", ["keys.py", "_staging.py"])
def test_the_checks_see_a_second_module_of_one_name(tmp_path: Path, name: str) -> None:
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "a" / name).write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "b" / name).write_text("x = 1\n" * MAX_LINES)
    assert duplicate_names(tmp_path) == {name: [f"a/{name}", f"b/{name}"]}
    assert long_modules(tmp_path) == {f"a/{name}": MAX_LINES + 1}
