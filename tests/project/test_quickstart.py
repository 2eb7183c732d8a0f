"""The README's quick start runs and prints what the README shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mmkey import EmbeddingKey

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def test_quickstart_runs_and_encodes_once() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    key = EmbeddingKey.from_key(lines[0])
    assert key.namespace == "qwen2-vl-7b@main"
    assert lines[1] == "2 embeddings of shape (16, 8); encoder called 1 time(s)"
    assert lines[2].startswith("CacheStats(hits=2, misses=0, inserts=1,")
