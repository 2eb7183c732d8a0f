"""What a bare GPU machine gets (`scripts/gpu-carry.sh`, `scripts/gpu-check.sh`): the carried
packages follow SGLang's pins, and the GPU check says SKIP on a machine without a GPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def pins(path: Path) -> dict[str, str]:
    """``name -> version`` of a requirements file of ``name==version`` lines."""
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not pinned with =="
            found[re.sub(r"[-_.]+", "-", name.lower())] = version
    return found


def test_the_carried_packages_are_sglangs_pins() -> None:
    carried = pins(SCRIPTS / "gpu-carry-requirements.txt")
    sglang = pins(SCRIPTS / "sglang-requirements.txt")
    assert {"sglang", "mooncake-transfer-engine-non-cuda", "blake3"} <= carried.keys()
    drifted = {name: (v, sglang.get(name)) for name, v in carried.items() if sglang.get(name) != v}
    assert not drifted, f"carried pins that differ from sglang-requirements.txt: {drifted}"


def test_the_gpu_check_skips_on_a_machine_without_an_nvidia_driver(tmp_path: Path) -> None:
    # a PATH with no nvidia-smi: the check runs nothing and passes
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "mktemp", "rm", "dirname"):
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu-check.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(bin_dir)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu-check: SKIP (no nvidia-smi: no NVIDIA driver on this machine)"
