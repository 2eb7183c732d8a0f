"""Local checkpoints for the identity and namespace tests (no vLLM needed): weights files
written by hand, and a hook counting the weights files hashed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from mmkey.integrations.vllm import _identity as identity_module


def write_weights(path: Path, tensors: dict[str, bytes], *, cut: int = 0) -> Path:
    """A safetensors file of U8 tensors; `cut` bytes short of what its header says."""
    header: dict[str, object] = {}
    offset = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(header).encode()
    body = b"".join(tensors.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(head)) + head + body[: len(body) - cut])
    return path


def write_checkpoint(
    root: Path,
    tensors: dict[str, bytes],
    *,
    config: dict[str, object] | None = None,
    preprocessor: dict[str, object] | None = None,
) -> Path:
    """A minimal local checkpoint: config.json, preprocessor_config.json, one safetensors file."""
    write_weights(root / "model.safetensors", tensors)
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "_name_or_path": str(root), "hidden": 8}
    (root / "config.json").write_text(json.dumps(config if config is not None else cfg))
    (root / "preprocessor_config.json").write_text(json.dumps(preprocessor or {"size": 336}))
    return root


def counted_file_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The weights files hashed from now on (read whole, not taken from the memo), in order."""
    reads: list[Path] = []
    real = identity_module._hash_file

    def counted(p: Path) -> str:
        reads.append(p)
        return real(p)

    monkeypatch.setattr(identity_module, "_hash_file", counted)
    return reads
