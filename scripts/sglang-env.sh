#!/bin/sh
# Build SGLang's test environment in $1 (default .venv-sglang): Python 3.11, uv, torch, then the
# pinned packages of sglang-requirements.txt without dependency resolution, SGLang's CPU patch
# (patches/sglang-0.5.23-cpu-global-cache.patch), then mmkey. torch
# is the CPU build (TORCH_PIN, from $TORCH_FROM's wheel folders or pip's configuration) with
# sglang-requirements-cpu.txt; SGLANG_TORCH=cuda takes SGLang's own pin, the CUDA build, with
# sglang-requirements-cuda.txt from this machine's wheel folders (for a GPU machine). No cache
# is kept outside the environment unless UV_CACHE_DIR names one (make gives all the
# environments one: .uv-cache).
set -eu
[ -n "${UV_CACHE_DIR:-}" ] || export UV_NO_CACHE=1
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
# the CPU torch first, unless SGLang's own CUDA pin comes with its requirements below
if [ "$torch" = cuda ]; then
    sh scripts/new-venv.sh "$python" "$venv"
else
    sh scripts/new-venv.sh "$python" "$venv" "$torch_pin"
fi
uv=${UV:-$venv/bin/uv}
if [ "$torch" = cuda ]; then
    # shellcheck disable=SC2086  # $links is a list of options
    "$uv" pip install -q --python "$venv/bin/python" --no-deps --no-index $links \
        -r scripts/sglang-requirements-cuda.txt
else
    # shellcheck disable=SC2086  # $links is a list of options
    "$uv" pip install -q --python "$venv/bin/python" --no-deps $links \
        -r scripts/sglang-requirements-cpu.txt
fi
"$uv" pip install -q --python "$venv/bin/python" --no-deps -r scripts/sglang-requirements.txt
if [ "$torch" = cpu ]; then
    sh scripts/guard-torchvision.sh "$venv"
fi
# SGLang's global embedding cache on a host without an accelerator (upstreamable; no GPU path
# changes): pageable pools, a synchronous page-run copy for CPU tensors, no CUDA stream sync
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
patch -p1 --forward --quiet -d "$site" -i "$PWD/patches/sglang-0.5.23-cpu-global-cache.patch"
"$uv" pip install -q --python "$venv/bin/python" --no-deps -e .
