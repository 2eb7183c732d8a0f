#!/bin/sh
# System libraries the CPU Mooncake wheel links against (Debian). Skipped when present.
set -eu
if ldconfig -p | grep -q 'libibverbs\.so\.1' && ldconfig -p | grep -q 'libnuma\.so\.1'; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    libibverbs1 libnuma1 libcurl4 >/dev/null
