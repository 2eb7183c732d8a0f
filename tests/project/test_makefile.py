"""The Makefile's stamps (what `make` takes as built, read from its dry runs) and the versions
its type checks cover."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dry_run(target: str, **variables: str) -> str:
    """What ``make -n`` would run for `target` with `variables` set on its command line."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    done = subprocess.run(
        [make, "-n", "--no-print-directory", *(f"{k}={v}" for k, v in variables.items()), target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


@pytest.mark.parametrize(
    ("built", "wanted", "rebuilt"), [("cpu", "cpu", False), ("cuda", "cpu", True), ("cpu", "cuda", True)]
)
def test_the_sglang_environment_is_rebuilt_for_the_other_torch(
    tmp_path: Path, built: str, wanted: str, rebuilt: bool
) -> None:
    venv = tmp_path / ".venv-sglang"
    venv.mkdir()
    (venv / f".ready-{built}").touch()  # newer than every file it is built from
    planned = dry_run("test-sglang-pytest", SGLANG_VENV=str(venv), SGLANG_TORCH=wanted)
    assert ("scripts/sglang-env.sh" in planned) is rebuilt, planned
    assert (f"SGLANG_TORCH={wanted}" in planned) is rebuilt, planned
    assert f"{venv}/bin/python -m pytest" in planned


def test_the_version_the_matrix_leaves_to_make_typecheck_is_the_oldest_both_checkers_check() -> None:
    """`scripts/test-matrix.sh` skips the types of `mypy.ini`'s version: pyright's
    configuration must name the same one, the oldest the project supports."""
    mypy = configparser.ConfigParser()
    mypy.read(ROOT / "mypy.ini")
    pyright = json.loads((ROOT / "pyrightconfig.json").read_text())
    oldest = re.search(r'^requires-python = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert oldest is not None
    assert mypy["mypy"]["python_version"] == pyright["pythonVersion"]
    assert oldest.group(1) == f">={pyright['pythonVersion']}"
