"""What a bare GPU machine gets (`scripts/gpu-carry.sh`, `scripts/gpu-check.sh`): the carried
packages follow SGLang's pins, and the GPU check says SKIP on a machine without a GPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
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


def _sglang_metadata(site: Path) -> None:
    """A stand-in for SGLang 0.5.23's installed metadata: its sglang-kernel and torch pins."""
    info = site / "sglang-0.5.23.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n"
        "Requires-Dist: sglang-kernel==0.4.10\nRequires-Dist: torch==2.14.1\n"
        'Requires-Dist: torch==9.9; extra == "other"\n'
    )


STAND_IN_CONTRACT = """
import sys

import sgl_kernel
from sgl_kernel import silu_and_mul, write, probe
from sgl_kernel.flash_attn import flash_attn_varlen_func
import sgl_kernel.elementwise.deeper as deeper

assert sys.modules["sgl_kernel"] is sgl_kernel
assert sgl_kernel.__sgl_kernel_standin__ == "sglang-kernel 0.4.10 needs torch 2.14.1; here 2.11.0"
assert not hasattr(sgl_kernel, "__all__") and not hasattr(silu_and_mul, "__wrapped__")
kernels = [silu_and_mul, write, probe, flash_attn_varlen_func, deeper.fused_add_rmsnorm,
           sgl_kernel.gemm.fp8_scaled_mm.default, sgl_kernel.common_ops]
for kernel in kernels:
    try:
        kernel(1, out=2)
    except RuntimeError as error:
        print(f"{error}")
    else:
        sys.exit(f"{kernel!r} computed something")
"""


def test_the_sgl_kernel_stand_in_imports_anything_and_computes_nothing(tmp_path: Path) -> None:
    reason = "sglang-kernel 0.4.10 needs torch 2.14.1; here 2.11.0"
    written = subprocess.run(
        [sys.executable, str(SCRIPTS / "sgl_kernel_standin.py"), str(tmp_path), "--reason", reason],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert written.returncode == 0, written.stderr
    assert (tmp_path / "sgl_kernel" / "__init__.py").is_file()
    done = subprocess.run(
        [sys.executable, "-c", STAND_IN_CONTRACT],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    raised = done.stdout.splitlines()
    assert len(raised) == 7
    names = ["silu_and_mul", "write", "probe", "flash_attn.flash_attn_varlen_func",
             "elementwise.deeper.fused_add_rmsnorm", "gemm.fp8_scaled_mm.default", "common_ops"]  # fmt: skip
    for line, name in zip(raised, names, strict=True):
        assert line == (
            f"sgl_kernel.{name} was called, but sgl_kernel here is an import stand-in that computes "
            f"nothing: {reason}"
        )


def test_the_probe_says_why_the_real_kernel_is_not_used(tmp_path: Path) -> None:
    _sglang_metadata(tmp_path)
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "sgl_kernel_standin.py"), "--probe"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(
        r"stand-in sglang-kernel 0\.4\.10 needs torch 2\.14\.1; this machine has \S+ "
        r"\(sglang-kernel is not installed: import sgl_kernel: ModuleNotFoundError: "
        r"No module named 'sgl_kernel'\)",
        done.stdout.strip(),
    ), done.stdout


FAKE_PYTHON = """#!/usr/bin/env bash
# the GPU check's python, short of a GPU: torch "has CUDA", the two steps report what they see
case "$1" in
    -c) case "$2" in
            *torch.version.cuda*) exit 1 ;;  # not the CPU torch
            *is_available*) exit 0 ;;        # a CUDA device
        esac ;;
    -m) echo "2 passed in 0.50s"; exit 0 ;;
    scripts/sglang_e2e.py)
        stand_in=$(REAL -c 'import sgl_kernel; print(hasattr(sgl_kernel, "__sgl_kernel_standin__"))' \\
            2>&1 | tail -n 1)
        printf '{"ok": true, "stand_in": "%s", "skip": "%s"}\\n' "$stand_in" \\
            "${SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK:-}"
        exit 0 ;;
esac
exec REAL "$@"
"""


def _gpu_check_with_a_fake_gpu(tmp_path: Path, pythonpath: Path) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    python = bin_dir / "python"
    python.write_text(FAKE_PYTHON.replace("REAL", sys.executable))
    for tool in (bin_dir / "nvidia-smi", python):
        tool.chmod(0o755)
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu-check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "PYTHON": str(python),
            "PYTHONPATH": str(pythonpath),
        },
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()


def test_the_gpu_check_summary_names_the_sgl_kernel_stand_in_and_why(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _sglang_metadata(site)
    *_, summary = _gpu_check_with_a_fake_gpu(tmp_path, site)
    assert re.fullmatch(
        r"gpu-check: PASS \(sgl_kernel: STAND-IN, imports only, none of its kernels ran: "
        r"sglang-kernel 0\.4\.10 needs torch 2\.14\.1; this machine has \S+ \(sglang-kernel is not "
        r"installed: import sgl_kernel: ModuleNotFoundError: No module named 'sgl_kernel'\); "
        r"CUDA-marked tests: 2 passed in 0\.50s; encode servers: "
        r'\{"ok": true, "stand_in": "True", "skip": "1"\}\)',
        summary,
    ), summary


def test_the_gpu_check_uses_a_real_sgl_kernel_where_one_imports(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "sgl_kernel").mkdir(parents=True)
    (site / "sgl_kernel" / "__init__.py").write_text("")
    info = site / "sglang_kernel-0.4.10.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-kernel\nVersion: 0.4.10\n")
    lines = _gpu_check_with_a_fake_gpu(tmp_path, site)
    assert lines[-1] == (
        "gpu-check: PASS (sgl_kernel: real, sglang-kernel 0.4.10; CUDA-marked tests: 2 passed in "
        '0.50s; encode servers: {"ok": true, "stand_in": "False", "skip": ""})'
    ), lines
