"""Shared set-up of the SGLang integration tests: the import guard, configs, a controller.

The tests run against the real SGLang wheel (``make test-sglang`` builds its environment).
Where SGLang is not importable they skip, unless ``MMKEY_REQUIRE_SGLANG=1`` (CI) makes
that a failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING

from tests._support import MiB, require_stack, wait_until

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.embedding_cache_controller import EmbeddingCacheController
    from sglang.srt.mem_cache.embedding_store import EmbeddingStore
    from sglang.srt.multimodal.modality import Modality as SGLangModality

REQUIRE_ENV = "MMKEY_REQUIRE_SGLANG"


def require_sglang() -> None:
    """Skip the calling test module when SGLang does not import (fail under MMKEY_REQUIRE_SGLANG=1)."""
    require_stack(
        "sglang.srt.mem_cache.embedding_store",
        stack="SGLang",
        require_env=REQUIRE_ENV,
        make_target="test-sglang",
    )


@contextlib.contextmanager
def unpinned_controller(
    store: EmbeddingStore,
    dims: dict[str, int],
    dtype: torch.dtype,
    pool_mib: float = 8.0,
    *,
    pinned: bool = False,
) -> Iterator[EmbeddingCacheController]:
    """SGLang's own `EmbeddingCacheController` with its pools in pageable memory (pinned, as
    SGLang makes them, with `pinned`: that needs an NVIDIA driver).

    Pinning host memory needs an NVIDIA driver; everything else (pages, the I/O thread,
    the LRU, the store calls) is SGLang's code. Stops the I/O thread on exit.
    """
    from sglang.srt.mem_cache.embedding_cache_controller import (
        EmbeddingCacheController,
        EmbeddingPool,
    )
    from sglang.srt.multimodal.modality import Modality
    from sglang.srt.runtime_context import get_parallel

    class UnpinnedController(EmbeddingCacheController):
        def _create_pools(self, pin_memory: bool) -> tuple[EmbeddingPool, EmbeddingPool]:
            return super()._create_pools(pin_memory=pinned)

    hidden = {Modality[name.upper()]: dim for name, dim in dims.items()}
    with get_parallel().override(tp_size=1, tp_rank=0, tp_group=SimpleNamespace(cpu_group=None)):
        controller = UnpinnedController(
            store,
            max_pool_size_gb=pool_mib / 1024,
            hidden_dims=hidden,
            dtype=dtype,
        )
    try:
        yield controller
    finally:
        controller.stop_event.set()
        controller.io_thread.join(timeout=10)


def fill(
    controller: EmbeddingCacheController, mm_hash: str, tensor: torch.Tensor, modality: SGLangModality
) -> None:
    """Put `tensor` into the controller's host pool as a READY entry.

    Stands in for SGLang's `store_to_pool_async`, which copies from a CUDA tensor; the page
    allocation and the copy into page runs are SGLang's own.
    """
    from sglang.srt.mem_cache.embedding_cache_controller import EmbeddingCacheEntry, EntryState

    pool = controller._get_pool(modality)
    assert pool is not None
    with controller.lock:
        runs = controller._allocate_with_eviction(pool, tensor.shape[0])
        assert runs is not None
        entry = EmbeddingCacheEntry(
            hash=mm_hash,
            modality=modality,
            num_tokens=tensor.shape[0],
            dim=tensor.shape[1],
            page_runs=runs,
            state=EntryState.FILLING,
        )
        controller.entries[mm_hash] = entry
    controller._copy_embedding_page_runs(tensor, pool.tensor, entry, pool, src_is_pool=False)
    with controller.lock:
        controller._mark_ready(entry)


def publish(controller: EmbeddingCacheController, hashes: list[str], modality: SGLangModality) -> None:
    """SGLang's insert_batch, waiting until its I/O thread has put every entry."""
    controller.insert_batch(hashes, modality)
    assert wait_until(lambda: all(controller.entries[h].ref_count == 0 for h in hashes), 30)


def fetch(
    controller: EmbeddingCacheController, hashes: list[str], tokens: list[int], modality: SGLangModality
) -> list[torch.Tensor | None]:
    """SGLang's prefetch and pool views: the embedding each hash landed as, or None."""
    import torch

    controller.prefetch("req", hashes, tokens, modality)
    assert wait_until(lambda: controller.check_prefetch_progress("req"), 30)
    views = controller.get_pool_views(hashes)
    found = [None if v is None else torch.cat(v).clone() for v in views]
    controller.release_pool_views([h for h, v in zip(hashes, views, strict=True) if v is not None])
    return found


__all__ = ["MiB", "fetch", "fill", "publish", "require_sglang", "unpinned_controller", "wait_until"]
