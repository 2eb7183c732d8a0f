#!/usr/bin/env bash
# Check stubs/sglang against the installed SGLang (run with SGLang's environment's python:
# PYTHON=.venv-sglang/bin/python). The stubs cover only the names mmkey and its tests use, so
# names missing from them are ignored; everything stubbed must match SGLang.
#
# stubtest compares names, kinds, signatures and defaults with the runtime. It runs on the
# project's mypy.ini, but with torch not followed (`torch.Tensor` in a stub is Any here):
# analysing torch was two thirds of this check's CPU, and `make mypy` already checks these
# stubs, torch and all, wherever mmkey imports them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
config=$(mktemp)
trap 'rm -f "$config"' EXIT
{ cat mypy.ini; printf '\n[mypy-torch.*]\nfollow_imports = skip\nfollow_imports_for_stubs = True\n'; } >"$config"
MYPYPATH=stubs "${PYTHON:-python}" -m mypy.stubtest --ignore-missing-stub --mypy-config-file "$config" \
    sglang.srt.mem_cache.embedding_store sglang.srt.mem_cache.embedding_cache_controller \
    sglang.srt.plugins sglang.srt.multimodal.modality sglang.srt.runtime_context sglang.srt.managers.mm_utils \
    sglang.srt.disaggregation.encoder.server sglang.srt.disaggregation.encoder.runtime \
    sglang.srt.disaggregation.encoder.grpc_server "$@"
