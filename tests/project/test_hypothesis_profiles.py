"""Which hypothesis profile a run loads: ``dev`` locally, ``ci`` under CI, or the one named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from tests._hypothesis_profiles import profile_for

ROOT = Path(__file__).resolve().parents[2]
# what the suite's conftest loads when a fresh interpreter imports it
_LOADED = (
    "import sys; sys.path.insert(0, sys.argv[1]); import tests.conftest; from hypothesis import settings; "
    "d = settings.default; print(settings.get_current_profile_name(), d.derandomize, d.max_examples)"
)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "dev"),
        ({"CI": "true"}, "ci"),
        ({"CI": "1"}, "ci"),
        ({"CI": ""}, "dev"),
        ({"CI": "false"}, "dev"),
        ({"CI": "0"}, "dev"),
        ({"HYPOTHESIS_PROFILE": "quick"}, "quick"),
        ({"HYPOTHESIS_PROFILE": "quick", "CI": "true"}, "quick"),
        ({"HYPOTHESIS_PROFILE": "dev", "CI": "true"}, "dev"),
        ({"HYPOTHESIS_PROFILE": "", "CI": "true"}, "ci"),
    ],
)
def test_the_environment_selects_the_profile(environ: dict[str, str], expected: str) -> None:
    assert profile_for(environ) == expected


def test_ci_is_derandomized_and_dev_explores() -> None:
    ci, dev, quick = (settings.get_profile(name) for name in ("ci", "dev", "quick"))
    assert ci.derandomize and quick.derandomize and not dev.derandomize
    assert ci.deadline is None and dev.deadline is None and quick.deadline is None
    assert quick.max_examples < ci.max_examples


def test_this_run_loaded_the_profile_its_environment_selects() -> None:
    assert settings.get_current_profile_name() == profile_for(os.environ)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "dev False 100"),
        ({"CI": "true"}, "ci True 100"),
        ({"CI": "true", "HYPOTHESIS_PROFILE": "quick"}, "quick True 10"),
        ({"HYPOTHESIS_PROFILE": "ci"}, "ci True 100"),
        ({"HYPOTHESIS_PROFILE": "dev", "CI": "true"}, "dev False 100"),
    ],
)
def test_a_fresh_run_loads_the_selected_profile(environ: dict[str, str], expected: str) -> None:
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    done = subprocess.run(
        [sys.executable, "-c", _LOADED, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **environ},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected.split()
