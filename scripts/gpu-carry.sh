#!/usr/bin/env bash
# Pack, on this machine, what scripts/gpu-check.sh needs on a bare GPU machine: one whose image
# has CUDA torch and Python 3.12 but no SGLang, no Mooncake and no network. Into .gpu-carry/
# (gitignored), small enough to travel with the working tree (at most 60 MiB):
#   site.tar.xz  the packages of gpu-carry-requirements.txt, installed for that Python
#                (binary wheels only; Mooncake's benchmark binaries and SGLang's are left out)
#   wheels/      mmkey's build backend, so the GPU machine installs the working tree itself
#   debs/        the Debian libraries Mooncake's binding links against; gpu-check.sh puts on
#                the library path only those the GPU machine lacks
# Then, there: scripts/gpu-check.sh (it finds .gpu-carry/ when .venv-sglang is absent). No
# sglang-kernel: too large, and built for another torch than the image's; gpu-check.sh puts an
# import stand-in for sgl_kernel on the path instead (scripts/sgl_kernel_standin.py).
#   scripts/gpu-carry.sh          # GPU_PYTHON_VERSION=3.11 packs for another Python
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=${GPU_PYTHON_VERSION:-3.12}
pip=(env PIP_ROOT_USER_ACTION=ignore python3 -m pip --disable-pip-version-check)
out=.gpu-carry
limit=$((60 << 20))
work=$(mktemp -d "${TMPDIR:-/tmp}/mmkey-gpu-carry.XXXXXX")
trap 'rm -rf "$work"' EXIT
rm -rf "$out"
mkdir -p "$out/wheels" "$out/debs"

platforms=()
for glibc in 2_17 2_24 2_26 2_27 2_28 2_31 2_34; do platforms+=(--platform "manylinux_${glibc}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64)
echo "gpu-carry: packages for CPython $version"
"${pip[@]}" install -q --no-deps --no-compile --only-binary=:all: --implementation cp \
    --python-version "$version" "${platforms[@]}" --target "$work/site" \
    -r scripts/gpu-carry-requirements.txt
rm -f "$work/site/mooncake/transfer_engine_bench" "$work/site/mooncake/mooncake_client" \
    "$work/site/sglang/srt/rust_extensions/"_bench*.so
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$work/site" -cf - . | xz -9 -T0 >"$out/site.tar.xz"

"${pip[@]}" download -q --no-deps --only-binary=:all: -d "$out/wheels" \
    hatchling==1.33.0 trove-classifiers==2026.9.21.13 tomlkit==0.15.2 pathspec==1.1.1 pluggy==1.7.0 \
    packaging==26.4

# Mooncake's binding needs libibverbs, libnuma and libcurl (and what libcurl needs beyond a
# base system); apt-get download fetches the .deb files without installing them
(cd "$out/debs" && apt-get download -q -o APT::Sandbox::User=root libibverbs1 libnuma1 libcurl4 libnghttp2-14 libpsl5 \
    librtmp1 libssh2-1 libldap-2.5-0 libsasl2-2 libbrotli1 >/dev/null)

size=$(du -sb "$out" | cut -f1)
echo "gpu-carry: $out holds $((size >> 20)) MiB (limit $((limit >> 20)) MiB)"
if [ "$size" -gt "$limit" ]; then
    echo "gpu-carry: too large to travel with the working tree" >&2
    exit 1
fi
