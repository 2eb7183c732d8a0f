#!/usr/bin/env bash
# The checks on the oldest and the newest supported CPython (3.10 and 3.13 by default).
#
# Types: mypy (strict, the whole project) and pyright (typing_tests/) with --python-version
# of each, run by the dev environment's checkers (torch's own annotations come from there).
# mypy.ini and pyrightconfig.json name the oldest version, which `make typecheck` checks: the
# matrix checks the types of the others (a cold mypy run is over 30 s of CPU).
# Runtime: for each version whose interpreter this machine has, a venv of its own with
# mmkey's dependencies but NOT torch (for other Pythons than the dev one, pip would take a
# multi-GB CUDA build of torch), running the torch-free tests: key format, digests of bytes
# and identifiers, the Mooncake configuration, the deadline runner, import cost and the
# torch-free API. A version with no interpreter here is skipped with a line saying so.
#
# usage: scripts/test-matrix.sh [DEV_BIN]   (DEV_BIN: the dev venv's bin, default .venv/bin)
set -euo pipefail
cd "$(dirname "$0")/.."

DEV_BIN=${1:-.venv/bin}
VERSIONS=${MMKEY_MATRIX_VERSIONS:-3.10 3.13}
TORCH_FREE_TESTS=(
    tests/core/test_keys.py
    tests/core/test_key_properties.py
    tests/core/test_digest.py
    tests/core/test_golden.py
    tests/cache/mooncake/test_mooncake_config.py
    tests/core/test_lane.py
    tests/core/test_import_cost.py
    tests/core/test_without_torch.py
)
export PYRIGHT_PYTHON_IGNORE_WARNINGS=1

# an interpreter for version $1: `python3.X` on PATH, else one that pyenv installed
find_python() {
    local version=$1 candidate
    for candidate in "python$version" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/"python$version"; do
        if "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$version'.split('.'))))" 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

# mmkey's runtime dependencies without torch, the pure-Python extras, and the test runner
torch_free_requirements() {
    "$DEV_BIN/python" - <<'EOF'
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
wanted = [r for name in ("cli", "testing", "metrics") for r in extras.get(name, [])]
for requirement in project["dependencies"] + wanted + ["pytest-timeout>=2.2"]:
    if not requirement.replace(" ", "").startswith("torch"):
        print(requirement)
EOF
}

CONFIGURED=$(sed -n 's/^python_version *= *//p' mypy.ini)
for version in $VERSIONS; do
    start=$SECONDS
    if [ "$version" = "$CONFIGURED" ]; then
        echo "== Python $version: mypy and pyright check it with their configuration (make typecheck)"
    else
        echo "== Python $version: mypy and pyright with --python-version $version"
        PYTHONPATH="$PWD/src" "$DEV_BIN/mypy" --python-version "$version"
        "$DEV_BIN/pyright" --pythonpath "$DEV_BIN/python" --pythonversion "$version"
    fi

    if ! python=$(find_python "$version"); then
        echo "== Python $version: no interpreter on this machine; torch-free tests skipped"
        continue
    fi
    venv=".venv-py$version"
    stamp="$venv/.deps-$(torch_free_requirements | sha256sum | cut -c1-16)"
    if [ ! -e "$stamp" ]; then
        rm -rf "$venv"
        if [ -x "$DEV_BIN/uv" ]; then
            "$python" -m venv --without-pip "$venv"  # uv installs: no pip needed
            torch_free_requirements | xargs "$DEV_BIN/uv" pip install -q --python "$venv/bin/python"
        else
            "$python" -m venv "$venv"
            torch_free_requirements | xargs "$venv/bin/python" -m pip install -q --disable-pip-version-check
        fi
        touch "$stamp"
    fi
    echo "== Python $version ($python): torch-free tests, torch not installed"
    "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
        || { echo "torch is installed in $venv: these runs must go without it"; exit 1; }
    # hypothesis's `quick` profile: these runs check the interpreter; the main run explores
    PYTHONPATH="$PWD/src" HYPOTHESIS_PROFILE=quick "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        -m "not torch" "${TORCH_FREE_TESTS[@]}"
    echo "== Python $version: done in $((SECONDS - start)) s"
done
