"""Digests and keys do not depend on the process: same text under any PYTHONHASHSEED."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import torch
from mmkey import EmbeddingKey, HashScheme, Modality, hash_bytes, hash_tensor, identifier_digest
t = torch.arange(4096, dtype=torch.float32).reshape(64, 64).bfloat16()
for s in HashScheme:
    if s.hashes_content:
        print(EmbeddingKey("ns@x", Modality.IMAGE, s, hash_tensor(t, s)).to_key(), hash_bytes(b"x", s))
print(EmbeddingKey("ns@x", Modality.IMAGE, HashScheme.ID, identifier_digest("img-1")).to_key())
print(hash("randomised per process"))
"""


def run(seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
    ).stdout
    return out.splitlines()


def test_digests_are_equal_across_hash_seeds() -> None:
    first, second = run("1"), run("2")
    assert first[:-1] == second[:-1]
    # the control: Python's own hash() really did differ between the two processes
    assert first[-1] != second[-1]
