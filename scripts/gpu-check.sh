#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: every CUDA-marked test, then two SGLang encode
# servers on a tiny random-weight VLM sharing an embedding through mmkey's store
# (scripts/sglang_gpu_e2e.py: pinned pools, store_to_pool_async from CUDA, SGLang's GPU hash).
# Runs in SGLang's test environment (make .venv-sglang/.ready; its torch is a CUDA build).
# Prints one summary line; exit status 0 when everything passed or when there is no CUDA
# device (then it says SKIP and runs nothing). Takes a few minutes.
#   scripts/gpu-check.sh            # PYTHON=... to use another environment
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
python=${PYTHON:-.venv-sglang/bin/python}
out=$(mktemp -d "${TMPDIR:-/tmp}/mmkey-gpu-check.XXXXXX")
trap 'rm -rf "$out"' EXIT

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: SKIP (no nvidia-smi: no NVIDIA driver on this machine)"
    exit 0
fi
if [ ! -x "$python" ]; then
    echo "gpu-check: FAIL ($python not found: run make .venv-sglang/.ready first)"
    exit 1
fi
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "gpu-check: SKIP (torch in $python sees no CUDA device)"
    exit 0
fi

# every test file with a CUDA-marked test (they skip themselves where a stack is missing)
mapfile -t files < <(grep -rl --include='test_*.py' -E 'pytest\.mark\.gpu|mark\.gpu' tests | sort)
MMKEY_REQUIRE_MOONCAKE=1 MMKEY_REQUIRE_SGLANG=1 MC_LOG_LEVEL=ERROR \
    timeout 900 "$python" -m pytest -p no:cacheprovider -q -m gpu "${files[@]}" >"$out/pytest.log" 2>&1
tests_rc=$?
tests_summary=$(grep -E '^[0-9]+ (passed|failed|skipped|error)|(passed|failed|error)(,| in )' "$out/pytest.log" | tail -n 1)

timeout 900 "$python" scripts/sglang_gpu_e2e.py >"$out/e2e.log" 2>&1
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
echo "gpu-check: $verdict (CUDA-marked tests: ${tests_summary:-no summary, exit $tests_rc}; encode servers: ${e2e_summary:-no output, exit $e2e_rc})"
[ "$verdict" = PASS ]
