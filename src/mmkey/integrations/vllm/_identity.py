"""What a local vLLM checkpoint is, independent of where it lies: a digest of its contents.

`checkpoint_identity(directory)` covers the model's ``config.json`` (without the fields that
name a path or a library version), its processor configs, and the bytes of the vision
tower's weights (tensors named like a vision encoder or projector, read from the
``*.safetensors`` files by their headers' offsets; every tensor when none is named so). The
weights' digest of each file is remembered by path, size and modification time in
``$XDG_CACHE_HOME/mmkey/vllm-weights.json``, so a restart does not read them again.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["TOWER_MARKERS", "checkpoint_identity", "weights_digest"]

TOWER_MARKERS = ("vision", "visual", "multi_modal_projector", "mm_projector", "image_newline", "img_")
"""A tensor whose name contains one of these belongs to the vision side."""
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "_commit_hash")
_CHUNK = 16 << 20
_CACHE_VERSION = 1
_lock = threading.Lock()


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmkey" / "vllm-weights.json"


def _tensor_ranges(path: Path) -> Iterator[tuple[str, int, int]]:
    """(name, start, end) of each tensor in a safetensors file, file offsets, in name order."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(size))
    base = 8 + size
    for name in sorted(header):
        if name == "__metadata__":
            continue
        start, end = header[name]["data_offsets"]
        yield name, base + int(start), base + int(end)


def _hash_file(path: Path) -> str:
    import blake3

    ranges = list(_tensor_ranges(path))
    chosen = [r for r in ranges if any(m in r[0] for m in TOWER_MARKERS)] or ranges
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with path.open("rb") as f:
        for name, start, end in chosen:
            digest.update(name.encode() + b"\x00" + struct.pack("<Q", end - start))
            f.seek(start)
            left = end - start
            while left > 0:
                block = f.read(min(_CHUNK, left))
                if not block:
                    raise ValueError(f"{path} is shorter than its safetensors header says")
                digest.update(block)
                left -= len(block)
    return str(digest.hexdigest())


def weights_digest(path: Path) -> str:
    """The digest of a safetensors file's vision weights, remembered by path, size and mtime."""
    stat = path.stat()
    memo_key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    cache = _cache_file()
    with _lock:
        try:
            memo: dict[str, Any] = json.loads(cache.read_text())
            if memo.get("version") != _CACHE_VERSION:
                memo = {}
        except (OSError, ValueError):
            memo = {}
        found = memo.get("files", {}).get(memo_key)
        if isinstance(found, str):
            return found
        digest = _hash_file(path)
        files = memo.setdefault("files", {})
        files[memo_key] = digest
        memo["version"] = _CACHE_VERSION
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(memo))
            tmp.replace(cache)
        except OSError:
            pass  # a read-only home: the digest is computed again next time
        return digest


def checkpoint_identity(directory: str | os.PathLike[str]) -> str | None:
    """A digest of what the checkpoint in `directory` is, or ``None`` when it is not a local
    directory with a ``config.json`` (a hub name: the caller falls back to name and revision)."""
    import blake3

    root = Path(directory)
    config_path = root / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    if isinstance(config, dict):
        for noise in _CONFIG_NOISE:
            config.pop(noise, None)
    parts = [b"mmkey-vllm-checkpoint-v1", json.dumps(config, sort_keys=True).encode()]
    for name in _PROCESSOR_FILES:
        path = root / name
        parts.append(name.encode() + b"=" + (path.read_bytes() if path.is_file() else b"-"))
    for path in sorted(root.glob("*.safetensors")):
        parts.append(b"w=" + weights_digest(path).encode())
    return str(blake3.blake3(b"\x00".join(parts)).hexdigest())
