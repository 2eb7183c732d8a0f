"""Hashing throughput, measured side by side with the field's algorithms (ANCHORS.md).

Shared by ``benchmarks/bench_hash.py`` (the full run) and ``mmkey bench`` (a quick one).
The anchors are re-expressed from their published descriptions, not copied.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from mmkey.digest import HashScheme

if TYPE_CHECKING:
    import torch

__all__ = ["Row", "feature_tensor", "hash_rows", "key_roundtrip_ns", "time_best"]


class Row(NamedTuple):
    """One measured path: its name, the dtype it read, GB/s and the ratio to a baseline."""

    path: str
    dtype: str
    gb_per_s: float
    vs_sglang_cpu: float
    vs_read_bandwidth: float


def feature_tensor(dtype_name: str = "float32", rows: int = 9216, cols: int = 1176) -> torch.Tensor:
    """A Qwen2-VL-sized ``pixel_values`` tensor (9216 x 1176: 43 MB in float32)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randn(rows, cols, generator=gen).to(getattr(torch, dtype_name))


def time_best(fn: Callable[[], object], repeats: int) -> float:
    """The best wall time of `repeats` calls, in seconds (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _one_thread(fn: Callable[[], object]) -> object:
    """`fn()` with torch limited to one thread: the bound for a sequential hash."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def sglang_cpu_anchor(t: torch.Tensor) -> int:
    """SGLang's CPU path as ANCHORS.md describes it: flatten, concatenate, SHA-256 over a
    bytes copy, first 8 bytes big-endian; the older version upcast bf16 to float32."""
    import torch

    flat = torch.cat([t.detach().flatten()])
    if flat.dtype == torch.bfloat16:
        flat = flat.float()
    return int.from_bytes(hashlib.sha256(flat.numpy().tobytes()).digest()[:8], "big")


def vllm_blake3_anchor(t: torch.Tensor) -> str:
    """A vLLM-style hasher: blake3 over the dtype string, the shape and a ``tobytes()`` copy
    (bf16 read through a uint8 view); a hex ``str`` digest."""
    import blake3
    import torch

    h = blake3.blake3()
    h.update(str(t.dtype).encode())
    h.update(str(tuple(t.shape)).encode())
    data = t.contiguous()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.uint8)
    h.update(data.numpy().tobytes())
    return h.hexdigest()


def hash_rows(dtype_names: tuple[str, ...] = ("float32", "bfloat16"), repeats: int = 5) -> list[Row]:
    """Every path on the same tensor per dtype, in one run: GB/s and ratios."""
    from mmkey.hashing import hash_tensor

    rows: list[Row] = []
    for dtype_name in dtype_names:
        t = feature_tensor(dtype_name)
        nbytes = t.numel() * t.element_size()
        paths: list[tuple[str, Callable[[], object]]] = [
            ("SGLang CPU algorithm (anchor)", functools.partial(sglang_cpu_anchor, t)),
            ("vLLM-style blake3 + tobytes (anchor)", functools.partial(vllm_blake3_anchor, t)),
            ("memory read bandwidth: tensor.sum()", t.sum),
            ("read bandwidth, 1 thread: tensor.sum()", functools.partial(_one_thread, t.sum)),
        ]
        paths.extend(
            (f"mmkey {s.value}", functools.partial(hash_tensor, t, s)) for s in HashScheme if s.hashes_content
        )
        speeds = {name: nbytes / time_best(fn, repeats) / 1e9 for name, fn in paths}
        sglang = speeds["SGLang CPU algorithm (anchor)"]
        read = speeds["memory read bandwidth: tensor.sum()"]
        rows.extend(Row(name, dtype_name, gbs, gbs / sglang, gbs / read) for name, gbs in speeds.items())
    return rows


def key_roundtrip_ns(count: int = 20000) -> tuple[float, float]:
    """Nanoseconds per key for ``to_key()`` and for ``from_key()``, over distinct keys."""
    from mmkey.digest import Modality, mm_hash
    from mmkey.keys import EmbeddingKey

    keys = [
        EmbeddingKey("qwen2-vl-7b@rev1", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i * 2654435761))
        for i in range(count)
    ]
    texts = [k.to_key() for k in keys]
    to_key = time_best(lambda: [k.to_key() for k in keys], 3) / count * 1e9
    from_key = time_best(lambda: [EmbeddingKey.from_key(s) for s in texts], 3) / count * 1e9
    return to_key, from_key
