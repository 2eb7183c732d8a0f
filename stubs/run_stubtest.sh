#!/usr/bin/env bash
# Check stubs/mooncake against the installed mooncake.store binding (run with the project's venv active).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MYPYPATH=stubs exec "${PYTHON:-python}" -m mypy.stubtest mooncake.store \
    --mypy-config-file mypy.ini --allowlist stubs/stubtest_allowlist.txt "$@"
