#!/bin/sh
# Build the real vLLM engine's test environment in $1 (default .venv-vllm-engine): Python 3.11,
# torch==2.13.0 (the CPU build), then every package of vllm-engine-requirements.txt without
# dependency resolution, then mmkey; torchvision, the index's CUDA build, is made to import
# beside the CPU torch by scripts/guard-torchvision.sh.
set -eu
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm-engine}
python=${VLLM_ENGINE_PYTHON:-python3.11}
torch_pin=${TORCH_PIN:-torch==2.13.0}
rm -rf "$venv"
# pip only where it installs something (no uv given, or torch from pip's configuration): the
# venv module's bundled pip costs seconds of CPU that uv never needs
if [ -n "${UV:-}" ] && [ -n "${TORCH_FROM:-}" ]; then
    "$python" -m venv --without-pip "$venv"
else
    "$python" -m venv "$venv"
fi
# uv: the Makefile's ($UV), else one installed into the environment
uv=${UV:-}
if [ -z "$uv" ]; then
    "$venv/bin/pip" install -q --no-cache-dir uv==0.13.9
    uv="$venv/bin/uv"
fi
# the CPU build of torch lies in a local wheel folder ($TORCH_FROM: --find-links options); uv
# looks only where it is told, and pip's configuration points there when none is named
if [ -n "${TORCH_FROM:-}" ]; then
    # shellcheck disable=SC2086  # several options, split on purpose
    "$uv" pip install -q --no-cache --python "$venv/bin/python" $TORCH_FROM "$torch_pin"
else
    "$venv/bin/pip" install -q --no-cache-dir "$torch_pin"
fi
"$uv" pip install -q --no-cache --python "$venv/bin/python" --no-deps -r scripts/vllm-engine-requirements.txt
"$uv" pip install -q --no-cache --python "$venv/bin/python" --no-deps -e .
sh scripts/guard-torchvision.sh "$venv"
"$venv/bin/python" - <<'PY'
import torch
import vllm

if not torch.__version__.endswith("+cpu"):
    raise SystemExit(f"vllm-engine-env: torch {torch.__version__} is not the CPU build")
print(f"vllm-engine-env: vllm {vllm.__version__}, torch {torch.__version__}")
PY
