"""The typing tests' own guard: an expected error that goes away fails mypy AND pyright.

typing_tests/ marks each line that must be rejected with one comment per checker. This runs
both checkers, with the project's own configuration files, over a probe module and checks
that an ignore with no error under it is reported by each, and that pyright does not take
mypy's comment for its own (so each checker's mark is checked by that checker).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# The probe brings its own function: importing mmkey would make each checker read torch's
# types too (12 s of a fresh mypy run), and what is tested here is the marks, not mmkey.
PROBE = """\
def mm_hash(data: bytes) -> int:
    return len(data)
mm_hash("5")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
mm_hash(b"5")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
mm_hash("5")  # type: ignore[arg-type]
mm_hash("5")  # pyright: ignore[reportArgumentType]
"""
# line 3: an expected error, marked for both: clean for both
# line 4: the error is gone: both must report the unused mark
# line 5: marked for mypy only: pyright must report the error itself
# line 6: marked for pyright only: mypy must report the error itself


def _tool(name: str) -> str:
    found = BIN / name
    if not found.exists():
        pytest.skip(f"{name} is not installed beside this interpreter (pip install -e '.[dev]')")
    return str(found)


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1", "PYTHONPATH": str(ROOT / "src")}


def test_mypy_reports_the_unused_mark_and_the_error_marked_for_pyright_only(
    probe: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            _tool("mypy"),
            "--config-file",
            str(ROOT / "mypy.ini"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            str(probe),
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    reported = {
        (int(line.split(":")[1]), line.rsplit("[", 1)[-1].rstrip("]"))
        for line in done.stdout.splitlines()
        if ": error: " in line
    }
    assert done.returncode == 1, done.stdout + done.stderr
    assert reported == {(4, "unused-ignore"), (6, "arg-type")}, done.stdout


def test_pyright_reports_the_unused_mark_and_ignores_mypys_comment(probe: Path, tmp_path: Path) -> None:
    config = json.loads((ROOT / "pyrightconfig.json").read_text())
    config.pop("include", None)
    config["extraPaths"] = [str(ROOT / "src")]
    config["stubPath"] = str(ROOT / "stubs")
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(config))
    done = subprocess.run(
        [_tool("pyright"), "--pythonpath", sys.executable, "--outputjson", str(probe)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    report = json.loads(done.stdout)
    reported = {
        (d["range"]["start"]["line"] + 1, d["rule"])
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    }
    assert done.returncode == 1, done.stdout + done.stderr
    assert reported == {(4, "reportUnnecessaryTypeIgnoreComment"), (5, "reportArgumentType")}, done.stdout
