#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: every CUDA-marked test, then two SGLang encode
# servers on a tiny random-weight VLM sharing an embedding through mmkey's store
# (scripts/sglang_e2e.py --device cuda, the script make test runs on CPU: every scenario, with
# pinned pools, store_to_pool_async from CUDA and SGLang's GPU hash).
# Runs in SGLang's test environment built with its CUDA torch
# (SGLANG_TORCH=cuda sh scripts/sglang-env.sh), or, where there is none (or one with the CPU
# torch), on the machine's own python3 and CUDA torch with what scripts/gpu-carry.sh packed
# into .gpu-carry/ (a bare GPU machine with no network: carry .gpu-carry with the working
# tree). Prints one summary line; exit status 0 when everything passed or when there is no
# CUDA device (then it says SKIP and runs nothing). Takes a few minutes.
# SGLang imports sgl_kernel (sglang-kernel) unconditionally on CUDA; where that fails (not
# installed, or its ops library built for another torch: sglang-kernel 0.4.10 needs torch
# 2.14.1, a lent machine's image has 2.11.0), an import stand-in goes first on the path
# (scripts/sgl_kernel_standin.py): everything of it imports, calling anything of it raises, so
# a path that needs a kernel fails loudly. The summary line says which sgl_kernel ran and why.
#   scripts/gpu-check.sh               # PYTHON=... to use another environment
#   scripts/gpu-check.sh --setup-only  # set up and check what imports, on any machine, also
#                                      # SGLang's CUDA import path (CUDA emulated where absent)
#   GPU_CHECK_USE_CARRY=1              # the carry even where .venv-sglang has CUDA torch
#   GPU_CHECK_STANDIN=0                # never a stand-in (to see what fails without one)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
setup_only=0
[ "${1:-}" = "--setup-only" ] && setup_only=1
python=${PYTHON:-.venv-sglang/bin/python}
carry=.gpu-carry
# each of the two steps: both, with the set-up, fit one 10-minute command on a lent machine
step_timeout=${GPU_CHECK_STEP_TIMEOUT:-270}
out=$(mktemp -d "${TMPDIR:-/tmp}/mmkey-gpu-check.XXXXXX")
trap 'rm -rf "$out"' EXIT

if [ "$setup_only" -eq 0 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: SKIP (no nvidia-smi: no NVIDIA driver on this machine)"
    exit 0
fi

# The carried packages on this machine's python3: unpacked into $out, mmkey installed from
# the working tree (for its entry points), and the carried libraries put on the library path
# only where this machine lacks them.
use_carry() {
    local site="$out/site" lib="$out/lib" so found missing
    python=${PYTHON_GPU:-python3}
    mkdir -p "$site" "$lib" "$out/debs"
    tar -C "$site" -xJf "$carry/site.tar.xz" || return 1
    "$python" -m pip install -q --disable-pip-version-check --no-index --find-links "$carry/wheels" \
        --target "$out/backend" hatchling || return 1
    PYTHONPATH="$out/backend" "$python" -m pip install -q --disable-pip-version-check --no-deps \
        --no-build-isolation --no-index --target "$site" . || return 1
    for deb in "$carry"/debs/*.deb; do dpkg-deb -x "$deb" "$out/debs" || return 1; done
    for _ in 1 2 3 4 5; do
        missing=$(LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
            ldd "$site/mooncake/store.so" "$site/mooncake/mooncake_master" "$lib"/* 2>/dev/null \
            | awk '/not found/ {print $1}' | sort -u)
        [ -z "$missing" ] && break
        for so in $missing; do
            found=$(find "$out/debs" -name "$so" | head -n 1)
            [ -n "$found" ] && ln -sf "$(readlink -f "$found")" "$lib/$so"
        done
    done
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu-check: carried packages on $("$python" -c 'import sys; print(sys.executable)'); libraries from the carry: $(ls "$lib" | tr '\n' ' ')"
}

# an environment with the CPU torch (make test builds .venv-sglang so) cannot run the GPU
# steps; asked once (importing torch takes seconds)
cpu_torch=0
if [ -x "$python" ] && "$python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
    cpu_torch=1
fi
if [ -z "${PYTHON:-}" ] && { [ ! -x "$python" ] || [ "$cpu_torch" -eq 1 ] || [ "${GPU_CHECK_USE_CARRY:-0}" = 1 ]; } \
    && [ -f "$carry/site.tar.xz" ]; then
    cpu_torch=0  # the machine's own torch
    use_carry >"$out/setup.log" 2>&1 || {
        echo "gpu-check: FAIL (setting up the carried packages failed)"
        tail -n 40 "$out/setup.log" >&2
        exit 1
    }
    tail -n 1 "$out/setup.log"
fi
if [ ! -x "$python" ] && ! command -v "$python" >/dev/null 2>&1; then
    echo "gpu-check: FAIL ($python not found: SGLANG_TORCH=cuda sh scripts/sglang-env.sh, or scripts/gpu-carry.sh on a machine with network)"
    exit 1
fi

# sgl_kernel: the real one where it imports on this python (in a fresh interpreter), else the
# stand-in, first on the path of everything after, with the reason every call of it raises;
# MMKEY_GPU_CHECK_SGL_KERNEL tells sglang_e2e.py which, so that it need not probe again
choose_sgl_kernel() {
    local probed reason
    probed=$(timeout 300 "$python" scripts/sgl_kernel_standin.py --probe 2>"$out/sgl_kernel.log" | tail -n 1)
    case "$probed" in
        "real "*)
            export MMKEY_GPU_CHECK_SGL_KERNEL="$probed"
            sgl_kernel_note="sgl_kernel: real, sglang-kernel ${probed#real }" ;;
        *)
            reason=${probed#stand-in }
            [ -n "$reason" ] || reason="the probe failed: $(tail -n 1 "$out/sgl_kernel.log")"
            if [ "${GPU_CHECK_STANDIN:-1}" = 0 ]; then
                export MMKEY_GPU_CHECK_SGL_KERNEL=absent
                sgl_kernel_note="sgl_kernel: NONE, stand-in switched off ($reason)"
            elif "$python" scripts/sgl_kernel_standin.py "$out/standin" --reason "$reason" >/dev/null; then
                export PYTHONPATH="$out/standin${PYTHONPATH:+:$PYTHONPATH}"
                # SGLang's start refuses without the sglang-kernel distribution it pins
                export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 MMKEY_GPU_CHECK_SGL_KERNEL=stand-in
                sgl_kernel_note="sgl_kernel: STAND-IN, imports only, none of its kernels ran: $reason"
            else
                echo "gpu-check: FAIL (could not write the sgl_kernel stand-in)"
                exit 1
            fi ;;
    esac
}

if [ "$setup_only" -eq 1 ]; then
    choose_sgl_kernel
    # what the GPU run needs, short of the GPU: the packages import, SGLang finds mmkey's
    # plugin, and a local master starts
    "$python" - <<'PY'
import importlib.metadata, sys

import mooncake.store  # noqa: F401
import sglang
import torch
from sglang.srt.disaggregation.encoder import server  # noqa: F401

from mmkey.testing.mooncake_master import running_master

plugins = [ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")]
if "mmkey.integrations.sglang:register_plugin" not in plugins:
    sys.exit(f"gpu-check: FAIL (SGLang does not find mmkey's plugin: {plugins})")
with running_master() as master:
    ready = master.is_ready()
if not ready:
    sys.exit("gpu-check: FAIL (the local master did not answer)")
print(f"gpu-check: SETUP OK (torch {torch.__version__}, CUDA {torch.cuda.is_available()}, "
      f"SGLang {sglang.__version__}, mmkey's plugin found, a master started)")
PY
    setup_rc=$?
    # the end-to-end script's own set-up: the tiny model built, a master and a holder started
    timeout "$step_timeout" "$python" scripts/sglang_e2e.py --setup-only >"$out/e2e-setup.log" 2>&1
    e2e_setup_rc=$?
    if [ "$e2e_setup_rc" -eq 0 ]; then
        echo "gpu-check: E2E SETUP OK ($(tail -n 1 "$out/e2e-setup.log"))"
    else
        echo "gpu-check: E2E SETUP FAIL (exit $e2e_setup_rc), last lines:"
        tail -n 20 "$out/e2e-setup.log"
    fi
    # SGLang's CUDA import path, in a child with CUDA emulated where there is none: what the
    # CUDA-marked tests and the encode servers import
    timeout "$step_timeout" "$python" scripts/sglang_cuda_imports.py >"$out/cuda-imports.log" 2>&1
    imports_rc=$?
    grep '^gpu-check: CUDA IMPORTS' "$out/cuda-imports.log" || {
        echo "gpu-check: CUDA IMPORTS FAIL (exit $imports_rc, no summary), last lines:"
        tail -n 20 "$out/cuda-imports.log"
    }
    echo "gpu-check: $sgl_kernel_note"
    [ "$setup_rc" -eq 0 ] && [ "$e2e_setup_rc" -eq 0 ] && [ "$imports_rc" -eq 0 ]
    exit $?
fi
if [ "$cpu_torch" -eq 1 ]; then
    echo "gpu-check: FAIL ($python has the CPU torch: SGLANG_TORCH=cuda sh scripts/sglang-env.sh, or scripts/gpu-carry.sh)"
    exit 1
fi
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "gpu-check: SKIP (torch in $python sees no CUDA device)"
    exit 0
fi
choose_sgl_kernel

# every test file with a CUDA-marked test (they skip themselves where a stack is missing)
mapfile -t files < <(grep -rl --include='test_*.py' -E 'pytest\.mark\.gpu|mark\.gpu' tests | sort)
MMKEY_REQUIRE_MOONCAKE=1 MMKEY_REQUIRE_SGLANG=1 MC_LOG_LEVEL=ERROR \
    timeout "$step_timeout" "$python" -m pytest -p no:cacheprovider -q -m gpu "${files[@]}" >"$out/pytest.log" 2>&1
tests_rc=$?
tests_summary=$(grep -E '^[0-9]+ (passed|failed|skipped|error)|(passed|failed|error)(,| in )' "$out/pytest.log" | tail -n 1)

timeout "$step_timeout" "$python" scripts/sglang_e2e.py --device cuda >"$out/e2e.log" 2>&1
e2e_rc=$?
e2e_summary=$(tail -n 1 "$out/e2e.log")

if [ "$tests_rc" -eq 0 ] && [ "$e2e_rc" -eq 0 ]; then
    verdict=PASS
else
    verdict=FAIL
    {
        echo "--- CUDA-marked tests (exit $tests_rc), last lines:"
        tail -n 40 "$out/pytest.log"
        echo "--- encode servers (exit $e2e_rc), last lines:"
        tail -n 40 "$out/e2e.log"
    } >&2
fi
echo "gpu-check: $verdict ($sgl_kernel_note; CUDA-marked tests: ${tests_summary:-no summary, exit $tests_rc}; encode servers: ${e2e_summary:-no output, exit $e2e_rc})"
[ "$verdict" = PASS ]
