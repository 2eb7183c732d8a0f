#!/bin/sh
# System packages the checks need (Debian), skipped when present: the libraries the CPU
# Mooncake wheel links against, and iproute2 (`ip`, `tc`) for the fleet tests that give each
# segment holder its own network namespace.
set -eu
if ldconfig -p | grep -q 'libibverbs\.so\.1' && ldconfig -p | grep -q 'libnuma\.so\.1' \
    && command -v ip >/dev/null && command -v tc >/dev/null; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    libibverbs1 libnuma1 libcurl4 iproute2 >/dev/null
