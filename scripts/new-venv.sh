#!/bin/sh
# A fresh environment for a stack's tests: new-venv.sh PYTHON VENV [TORCH_PIN]
# Removes VENV, creates it with PYTHON and, with TORCH_PIN, installs that torch (the CPU build:
# from $TORCH_FROM's wheel folders, --find-links options, by uv; else by pip, whose
# configuration names where it lies). uv is $UV, else one installed into VENV (VENV/bin/uv).
# The venv module's bundled pip goes in only where pip installs something: it costs seconds
# of CPU that uv never needs.
set -eu
# uv keeps no cache unless it is given one (make gives all the environments one: .uv-cache)
[ -n "${UV_CACHE_DIR:-}" ] || export UV_NO_CACHE=1
python=$1
venv=$2
torch_pin=${3:-}
rm -rf "$venv"
if [ -n "${UV:-}" ] && [ -n "${TORCH_FROM:-}" ]; then
    "$python" -m venv --without-pip "$venv"
else
    "$python" -m venv "$venv"
fi
uv=${UV:-}
if [ -z "$uv" ]; then
    "$venv/bin/pip" install -q --no-cache-dir uv==0.13.9
    uv="$venv/bin/uv"
fi
[ -n "$torch_pin" ] || exit 0
if [ -n "${TORCH_FROM:-}" ]; then
    # shellcheck disable=SC2086  # several options, split on purpose
    "$uv" pip install -q --python "$venv/bin/python" $TORCH_FROM "$torch_pin"
else
    "$venv/bin/pip" install -q --no-cache-dir "$torch_pin"
fi
