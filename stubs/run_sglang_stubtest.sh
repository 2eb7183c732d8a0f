#!/usr/bin/env bash
# Check stubs/sglang against the installed SGLang (run with SGLang's environment's python:
# PYTHON=.venv-sglang/bin/python). The stubs cover only the names mmkey and its tests use, so
# names missing from them are ignored; everything stubbed must match SGLang.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MYPYPATH=stubs exec "${PYTHON:-python}" -m mypy.stubtest --ignore-missing-stub --mypy-config-file mypy.ini \
    sglang.srt.mem_cache.embedding_store sglang.srt.mem_cache.embedding_cache_controller \
    sglang.srt.plugins sglang.srt.multimodal.modality sglang.srt.runtime_context sglang.srt.managers.mm_utils \
    sglang.srt.disaggregation.encoder.server sglang.srt.disaggregation.encoder.runtime \
    sglang.srt.disaggregation.encoder.grpc_server "$@"
