#!/bin/sh
# Build the real vLLM engine's test environment in $1 (default .venv-vllm-engine): Python 3.11,
# torch==2.13.0 (the CPU build), then every package of vllm-engine-requirements.txt without
# dependency resolution, then mmkey. torchvision from the index is a CUDA build whose C++ ops do
# not load beside the CPU torch; two of its meta registrations are not guarded on that, so
# importing it fails ("operator torchvision::nms does not exist"). They are guarded here the way
# torchvision guards the others; the image models the tests run use none of its C++ ops.
set -eu
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm-engine}
python=${VLLM_ENGINE_PYTHON:-python3.11}
torch_pin=${TORCH_PIN:-torch==2.13.0}
rm -rf "$venv"
"$python" -m venv "$venv"
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
meta=$("$venv/bin/python" -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')/_meta_registrations.py
sed -i \
    -e 's|^@torch.library.register_fake("torchvision::nms")$|@(torch.library.register_fake("torchvision::nms") if torchvision.extension._has_ops() else (lambda f: f))|' \
    -e 's|^@torch.library.register_fake("torchvision::qnms")$|@(torch.library.register_fake("torchvision::qnms") if torchvision.extension._has_ops() else (lambda f: f))|' \
    "$meta"
"$venv/bin/python" - <<'PY'
import torch
import torchvision  # noqa: F401  (fails here if the guard did not apply)
import vllm

if not torch.__version__.endswith("+cpu"):
    raise SystemExit(f"vllm-engine-env: torch {torch.__version__} is not the CPU build")
print(f"vllm-engine-env: vllm {vllm.__version__}, torch {torch.__version__}")
PY
