#!/bin/sh
# Build SGLang's test environment in $1 (default .venv-sglang): Python 3.11, uv, torch, then the
# pinned packages of sglang-requirements.txt without dependency resolution, then mmkey. torch
# is the CPU build (TORCH_PIN, from $TORCH_FROM's wheel folders or pip's configuration) with
# sglang-requirements-cpu.txt; SGLANG_TORCH=cuda takes SGLang's own pin, the CUDA build, with
# sglang-requirements-cuda.txt from this machine's wheel folders (for a GPU machine). No cache
# is kept outside the environment.
set -eu
cd "$(dirname "$0")/.."
venv=${1:-.venv-sglang}
python=${SGLANG_PYTHON:-python3.11}
torch=${SGLANG_TORCH:-cpu}
torch_pin=${TORCH_PIN:-torch==2.13.0}
links=""
for dir in /opt/pypi-more/files /opt/pypi/files /opt/wheels; do
    if [ -d "$dir" ]; then links="$links --find-links $dir"; fi
done
case $torch in
    cpu) ;;
    cuda)
        if [ -z "$links" ]; then
            echo "sglang-env: no local wheel folder holds SGLang's CUDA torch; see scripts/sglang-requirements-cuda.txt" >&2
            exit 1
        fi
        ;;
    *)
        echo "sglang-env: SGLANG_TORCH is cpu (the default) or cuda, not '$torch'" >&2
        exit 2
        ;;
esac
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
if [ "$torch" = cuda ]; then
    # shellcheck disable=SC2086  # $links is a list of options
    "$uv" pip install -q --no-cache --python "$venv/bin/python" --no-deps --no-index $links \
        -r scripts/sglang-requirements-cuda.txt
else
    if [ -n "${TORCH_FROM:-}" ]; then
        # shellcheck disable=SC2086  # several options, split on purpose
        "$uv" pip install -q --no-cache --python "$venv/bin/python" $TORCH_FROM "$torch_pin"
    else
        "$venv/bin/pip" install -q --no-cache-dir "$torch_pin"
    fi
    # shellcheck disable=SC2086  # $links is a list of options
    "$uv" pip install -q --no-cache --python "$venv/bin/python" --no-deps $links \
        -r scripts/sglang-requirements-cpu.txt
fi
"$uv" pip install -q --no-cache --python "$venv/bin/python" --no-deps -r scripts/sglang-requirements.txt
if [ "$torch" = cpu ]; then
    sh scripts/guard-torchvision.sh "$venv"
fi
"$uv" pip install -q --no-cache --python "$venv/bin/python" --no-deps -e .
