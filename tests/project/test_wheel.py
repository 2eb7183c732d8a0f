"""The wheel built from this tree: the package, and the SGLang guard beside it that works from
an installed wheel's site directory (tests/integrations/sglang/test_sglang_guard.py tests the
guard itself)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv is not None, "uv is part of the dev environment (make .venv/.dev)"
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([uv, "build", "-q", "--wheel", "-o", str(out), str(ROOT)], check=True, timeout=300)
    (built,) = out.glob("mmkey-*.whl")
    return built


def test_the_wheel_holds_the_package_and_the_guard_at_its_root(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    guard = {"_mmkey_sglang_guard.py", "mmkey-sglang-guard.pth"}
    assert {"mmkey/__init__.py", "mmkey/py.typed", *guard} <= names
    tops = {name.split("/")[0] for name in names}
    assert tops - {name for name in tops if name.endswith(".dist-info")} == {"mmkey", *guard}


@pytest.mark.parametrize(("switch", "guarded"), [("1", "_Guard"), ("0", "none")])
def test_the_wheels_pth_installs_the_guard_from_a_site_directory(
    wheel: Path, tmp_path: Path, switch: str, guarded: str
) -> None:
    site_dir = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site_dir)
    code = (
        "import site, sys; site.addsitedir(sys.argv[1]); "
        "print(type(sys.meta_path[0]).__name__ if '_mmkey_sglang_guard' in sys.modules else 'none')"
    )
    env = {**os.environ, "MMKEY_SGLANG_BACKEND": switch, "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(site_dir)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [guarded]
