"""The torch-free part of mmkey works in a process where torch cannot be imported.

Keys, digests of bytes and identifiers, the in-memory cache's bookkeeping, the Mooncake
configuration and the command line's `key` explainer need no tensor, so they must not need
torch: that is what runs on the Python versions for which no CPU torch is installed
(`make test-matrix`), and what a key-parsing tool that never touches a tensor relies on.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
import textwrap

import mmkey
from mmkey import EmbeddingKey, HashScheme, Modality, hash_bytes, identifier_digest

NEEDS_TORCH = (
    "mmkey.cli.demo.run",
    "mmkey.cli.demo.stream",
    "mmkey.cli.demo.vision",
    "mmkey.encoder",
    "mmkey.integrations",
)
"""Packages that hold tensor code by nature; every other module imports without torch."""

_BLOCK_TORCH = """
import importlib.abc, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""


def _run_without_torch(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _torch_free_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(mmkey.__path__, "mmkey.")]
    return sorted(n for n in names if not n.startswith(NEEDS_TORCH))


def test_the_block_really_keeps_torch_out() -> None:
    out = _run_without_torch(
        """
        try:
            import torch
        except ModuleNotFoundError:
            print("blocked")
        """
    )
    assert out.split() == ["blocked"]


def test_every_module_but_the_tensor_ones_imports_without_torch() -> None:
    modules = _torch_free_modules()
    assert {"mmkey.keys", "mmkey.hashing", "mmkey.cache.memory", "mmkey.cli"} <= set(modules)
    out = _run_without_torch(
        f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    assert out.split() == ["[]"]


def test_keys_digests_and_cache_bookkeeping_work_without_torch() -> None:
    key_text = "mmk1@org%2Fmodel%40rev@video@xxh3@" + "0" * 31 + "1"
    out = _run_without_torch(
        f"""
        import json
        from mmkey import (
            EmbeddingKey, HashScheme, MemoryCache, MooncakeConfig, hash_bytes,
            identifier_digest, mm_hash,
        )

        key = EmbeddingKey.from_key({key_text!r})
        cache = MemoryCache(1 << 20)
        print(json.dumps({{
            "key": key.to_key(),
            "namespace": key.namespace,
            "bytes": [hash_bytes(b"mmkey", s) for s in HashScheme if s.hashes_content],
            "identifier": identifier_digest("vllm-mm-hash"),
            "sglang_width": mm_hash(2**64 - 1, HashScheme.SGLANG),
            "exists": cache.batch_is_exist([key]),
            "got": cache.get_embeddings([key]),
            "misses": cache.stats().misses,
            "master": MooncakeConfig(master_server_address="127.0.0.1:1").master_server_address,
        }}))
        """
    )
    got = json.loads(out)
    key = EmbeddingKey.from_key(key_text)
    assert got == {
        "key": key_text,
        "namespace": "org/model@rev",
        "bytes": [hash_bytes(b"mmkey", s) for s in HashScheme if s.hashes_content],
        "identifier": identifier_digest("vllm-mm-hash"),
        "sglang_width": 2**64 - 1,
        "exists": [False],
        "got": [None],
        "misses": 1,
        "master": "127.0.0.1:1",
    }
    assert key.modality is Modality.VIDEO


def test_the_key_command_explains_a_key_without_torch() -> None:
    key = EmbeddingKey("qwen2-vl-7b", Modality.IMAGE, HashScheme.SGLANG, hash_bytes(b"x", HashScheme.SGLANG))
    out = _run_without_torch(
        f"""
        import sys
        from mmkey.cli import main
        sys.argv = ["mmkey", "key", {key.to_key()!r}]
        try:
            main()
        except SystemExit as stop:
            assert not stop.code, stop.code
        """
    )
    assert key.to_key() in out
    assert "qwen2-vl-7b" in out
    assert f"{key.digest:016x}" in out
