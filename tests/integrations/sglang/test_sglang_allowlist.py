"""An opted-in launcher whose ``SGLANG_PLUGINS`` leaves mmkey out: SGLang's real loader skips
mmkey's plugin, and the guard that ``mmkey-sglang-guard.pth`` installed at the interpreter's
start makes the encoder's backend construction refuse, instead of building SGLang's own
unverified store. One fresh interpreter of SGLang's environment, as SGLang's launcher is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integrations.sglang.sglang_support import require_sglang

require_sglang()

LAUNCHER = """
import json, sys
import sglang.srt.plugins as plugins
plugins.load_plugins()  # as SGLang's launcher does, honouring SGLANG_PLUGINS
from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory
entry = EmbeddingStoreFactory._registry["mooncake"]
try:
    EmbeddingStoreFactory.create_backend("mooncake")  # what the encoder calls at start
    refused = None
except ImportError as exc:
    refused = str(exc)
print(json.dumps({
    "mooncake": entry["module_path"],
    "refused": refused,
    "sglang_backend_imported": entry["module_path"] in sys.modules,
    "mmkey_plugin_imported": "mmkey.integrations.sglang._plugin" in sys.modules,
}))
"""


def launch(**env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", "MMKEY_SGLANG_BACKEND")}
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER],
        env={**base, "MMKEY_NAMESPACE": "allowlist-model", **env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_an_opted_in_encoder_whose_sglang_plugins_leave_out_mmkey_refuses_to_start() -> None:
    result = launch(MMKEY_SGLANG_BACKEND="1", SGLANG_PLUGINS="someother")
    assert result["mooncake"] == "sglang.srt.mem_cache.storage.mooncake_store.mooncake_embedding_store"
    assert result["mmkey_plugin_imported"] is False  # SGLang skipped mmkey's plugin
    refused = str(result["refused"])
    assert "SGLANG_PLUGINS='someother' does not list 'mmkey'" in refused
    assert "SGLANG_PLUGINS=someother,mmkey" in refused
    assert result["sglang_backend_imported"] is False  # nothing of SGLang's store ran
