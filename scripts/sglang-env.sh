#!/bin/sh
# Build SGLang's test environment in $1 (default .venv-sglang): Python 3.11, uv, then the
# pinned packages of sglang-requirements*.txt without dependency resolution, then mmkey.
# No cache is kept outside the environment.
set -eu
cd "$(dirname "$0")/.."
venv=${1:-.venv-sglang}
python=${SGLANG_PYTHON:-python3.11}
links=""
for dir in /opt/pypi-more/files /opt/pypi/files /opt/wheels; do
    if [ -d "$dir" ]; then links="$links --find-links $dir"; fi
done
if [ -z "$links" ]; then
    echo "sglang-env: no local wheel folder holds SGLang's CUDA torch; see scripts/sglang-requirements-disk.txt" >&2
    exit 1
fi
rm -rf "$venv"
"$python" -m venv "$venv"
# uv: the Makefile's ($UV), else one installed into the environment
uv=${UV:-}
if [ -z "$uv" ]; then
    "$venv/bin/pip" install -q --no-cache-dir uv==0.13.9
    uv="$venv/bin/uv"
fi
# shellcheck disable=SC2086  # $links is a list of options
"$uv" pip install -q --no-cache --python "$venv/bin/python" --no-deps --no-index $links \
    -r scripts/sglang-requirements-disk.txt
"$uv" pip install -q --no-cache --python "$venv/bin/python" --no-deps -r scripts/sglang-requirements.txt
"$uv" pip install -q --no-cache --python "$venv/bin/python" --no-deps -e .
