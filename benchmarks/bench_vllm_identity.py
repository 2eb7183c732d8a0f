"""What naming a checkpoint by its contents costs vLLM's start-up (`checkpoint_identity`).

Writes a safetensors file shaped like a 7B VLM's vision side (Qwen2-VL-7B: a 675M-parameter
bf16 tower, 1.35 GB) beside 64 MiB of language-model tensors that are not read, then times the
first start (the tower's bytes hashed; the file is in the page cache, as right after a model
download) and a restart (the digest remembered by path, size and mtime).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import time
from pathlib import Path

TOWER_BYTES = 1350 << 20
LM_BYTES = 64 << 20
CHUNK = 64 << 20


def write(root: Path) -> None:
    tensors = [(f"visual.blocks.{i}.weight", CHUNK) for i in range(TOWER_BYTES // CHUNK)]
    tensors.append(("model.embed_tokens.weight", LM_BYTES))
    header, offset = {}, 0
    for name, size in tensors:
        header[name] = {"dtype": "BF16", "shape": [size // 2], "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header).encode()
    block = os.urandom(CHUNK)
    with (root / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _, size in tensors:
            f.write(block[:size])
    (root / "config.json").write_text(json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"]}))


def main() -> None:
    from mmkey.integrations.vllm._identity import checkpoint_identity

    with tempfile.TemporaryDirectory(prefix="mmkey-bench-identity-") as tmp:
        root = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(root / "cache")
        write(root)
        start = time.perf_counter()
        checkpoint_identity(root)
        first = time.perf_counter() - start
        start = time.perf_counter()
        checkpoint_identity(root)
        again = time.perf_counter() - start
    print(
        f"| 7B VLM vision side ({TOWER_BYTES / (1 << 30):.2f} GiB) | first start {first:.2f} s "
        f"({TOWER_BYTES / first / (1 << 30):.1f} GiB/s) | restart {again * 1e3:.1f} ms |"
    )


if __name__ == "__main__":
    main()
