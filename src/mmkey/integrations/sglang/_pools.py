"""The host memory pools SGLang registers with its embedding store, and page addressing.

SGLang's `EmbeddingCacheController` keeps embeddings in two paged host pools, each a
contiguous ``[tokens, dim]`` tensor it hands to ``register_buffer``: the vision pool (images
and videos) first, then the audio pool. An embedding occupies whole rows of one pool,
possibly in several runs of pages; the store sees each run as an address and a byte size.
`PoolTable` maps those back to rows of the registered tensor, so the store knows the dtype,
the width and the modality of every transfer without trusting anything but its own record.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from mmkey.digest import Modality
from mmkey.errors import UnknownBuffer

if TYPE_CHECKING:
    import torch

__all__ = ["REGISTRATION_ORDER", "Pool", "PoolTable", "UnknownBuffer"]

REGISTRATION_ORDER = (Modality.IMAGE, Modality.AUDIO)
"""The modality of the first and the second pool registered without one: SGLang's
controller registers its vision pool (images and videos share it, and SGLang's hash alone
names an entry in it) and then its audio pool."""


@attrs.frozen(slots=True)
class Pool:
    """One registered pool: a contiguous 2-D tensor and the modality of its embeddings."""

    tensor: torch.Tensor
    modality: Modality
    start: int
    """Address of the first byte."""
    nbytes: int
    row_bytes: int
    """Bytes of one token's embedding (one row)."""

    @property
    def end(self) -> int:
        """Address one past the last byte."""
        return self.start + self.nbytes

    def rows(self, ptr: int, size: int) -> torch.Tensor:
        """The rows ``[ptr, ptr + size)`` as a view of the pool; `UnknownBuffer` if not whole rows."""
        offset = ptr - self.start
        if not (offset >= 0 and offset + size <= self.nbytes):
            raise UnknownBuffer(f"[{ptr:#x}, +{size}) lies outside the {self.modality.value} pool")
        if offset % self.row_bytes or size % self.row_bytes or size <= 0:
            raise UnknownBuffer(
                f"[{ptr:#x}, +{size}) is not whole rows of {self.row_bytes} bytes of the "
                f"{self.modality.value} pool"
            )
        first = offset // self.row_bytes
        return self.tensor[first : first + size // self.row_bytes]


class PoolTable:
    """The pools registered so far; thread-safe."""

    def __init__(self) -> None:
        self._pools: list[Pool] = []
        self._lock = threading.Lock()

    def register(self, tensor: torch.Tensor, modality: Modality | None = None) -> Pool:
        """Record `tensor` as a pool of `modality` (by `REGISTRATION_ORDER` when None).

        Raises `TypeError` for a tensor that is not a contiguous 2-D CPU tensor and
        `ValueError` for a third pool without a modality or one overlapping another.
        """
        import torch

        value: object = tensor
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"register_buffer() takes a torch.Tensor pool, got {type(value).__name__}")
        if tensor.dim() != 2 or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise TypeError(
                "an embedding pool must be a contiguous 2-D [tokens, dim] CPU tensor, got "
                f"shape {tuple(tensor.shape)} on {tensor.device}"
            )
        row_bytes = tensor.shape[1] * tensor.element_size()
        pool_start = tensor.data_ptr()
        with self._lock:
            if modality is None:
                if len(self._pools) >= len(REGISTRATION_ORDER):
                    raise ValueError("a third pool needs its modality: register_pool(tensor, modality)")
                modality = REGISTRATION_ORDER[len(self._pools)]
            pool = Pool(tensor, modality, pool_start, tensor.numel() * tensor.element_size(), row_bytes)
            for other in self._pools:
                if pool.start < other.end and other.start < pool.end:
                    raise ValueError(
                        f"the new {modality.value} pool overlaps the registered {other.modality.value} pool"
                    )
            self._pools.append(pool)
        return pool

    def pools(self) -> list[Pool]:
        """The registered pools, in registration order."""
        with self._lock:
            return list(self._pools)

    def modalities(self) -> list[Modality]:
        """The modalities of the registered pools (every one SGLang might use when none is)."""
        found = [pool.modality for pool in self.pools()]
        return list(dict.fromkeys(found)) or list(REGISTRATION_ORDER)

    def locate(self, ptrs: Sequence[int], sizes: Sequence[int]) -> tuple[Pool, list[torch.Tensor]]:
        """The pool holding every run of one embedding, and the runs as row views in order.

        Raises `UnknownBuffer` when the runs are empty, differ in number from the sizes,
        or leave the pool of the first run.
        """
        if len(ptrs) != len(sizes) or not ptrs:
            raise UnknownBuffer(f"an embedding needs matching runs, got {len(ptrs)} ptrs, {len(sizes)} sizes")
        pools = self.pools()
        pool = next((p for p in pools if p.start <= ptrs[0] < p.end), None)
        if pool is None:
            raise UnknownBuffer(
                f"address {ptrs[0]:#x} is in no registered pool; SGLang registers its pools "
                "with register_buffer() before any transfer"
            )
        return pool, [pool.rows(ptr, size) for ptr, size in zip(ptrs, sizes, strict=True)]
