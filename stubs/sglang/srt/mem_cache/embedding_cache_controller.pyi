import threading
from dataclasses import dataclass
from enum import Enum
from queue import Queue
from typing import Any

import torch
from sglang.srt.mem_cache.embedding_store import EmbeddingStore
from sglang.srt.multimodal.modality import Modality

TARGET_PAGE_BYTES: int
VISION_POOL_RATIO: float

class EntryState(Enum):
    FILLING = ...
    READY = ...

@dataclass(frozen=True)
class PageRun:
    start: int
    length: int

class RangePageAllocator:
    def __init__(self, num_pages: int) -> None: ...
    def allocate(self, num_tokens: int, page_size: int) -> list[PageRun] | None: ...
    def free(self, runs: list[PageRun]) -> None: ...
    @property
    def free_pages(self) -> int: ...

@dataclass
class EmbeddingPool:
    modality: str
    dim: int
    dtype: torch.dtype
    page_size: int
    tensor: torch.Tensor
    num_pages: int
    allocator: RangePageAllocator
    page_bytes: int
    pool_size_bytes: int
    pin_memory: bool = ...

@dataclass
class EmbeddingCacheEntry:
    hash: str
    modality: object
    num_tokens: int
    dim: int
    page_runs: list[PageRun]
    state: EntryState
    ref_count: int = ...

class EmbeddingPrefetchOperation:
    req_id: str
    keys: list[str]
    ptrs: list[list[int]]
    sizes: list[list[int]]
    is_finished: bool
    success: bool
    def __init__(
        self, req_id: str, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> None: ...
    def mark_done(self, success: bool) -> None: ...

class EmbeddingInsertOperation:
    keys: list[str]
    ptrs: list[list[int]]
    sizes: list[list[int]]
    def __init__(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> None: ...

class EmbeddingCacheController:
    embedding_store: EmbeddingStore
    prefetch_queue: Queue[EmbeddingPrefetchOperation]
    insert_queue: Queue[EmbeddingInsertOperation]
    vision_pool: EmbeddingPool
    audio_pool: EmbeddingPool
    entries: dict[str, EmbeddingCacheEntry]
    lock: threading.Lock
    stop_event: threading.Event
    io_thread: threading.Thread
    def __init__(
        self,
        embedding_store: EmbeddingStore,
        max_pool_size_gb: float = 4.0,
        hidden_dims: dict[Modality, int] | None = None,
        all_rank_get: bool = False,
        enable_eviction: bool = True,
        max_eviction_batch: int = 100,
        dtype: torch.dtype = ...,
    ) -> None: ...
    def _create_pools(self, pin_memory: bool) -> tuple[EmbeddingPool, EmbeddingPool]: ...
    def _get_pool(self, modality: Modality) -> EmbeddingPool | None: ...
    def _allocate_with_eviction(self, pool: EmbeddingPool, num_tokens: int) -> list[PageRun] | None: ...
    def _mark_ready(self, entry: EmbeddingCacheEntry) -> None: ...
    def _finish_get(self, op: EmbeddingPrefetchOperation, results: list[bool]) -> None: ...
    def _finish_put(self, op: EmbeddingInsertOperation, results: list[bool]) -> None: ...
    def _io_loop(self) -> None: ...
    def _evict_entry(self, mm_hash: str, remove_lru: bool = True) -> None: ...
    def _copy_embedding_page_runs(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        entry: EmbeddingCacheEntry,
        pool: EmbeddingPool,
        src_is_pool: bool,
        dst_token_offset: int = 0,
    ) -> None: ...
    def prefetch(
        self, req_id: str, mm_hashes: list[str], expected_tokens: list[int], modality: Modality | None = None
    ) -> None: ...
    def insert_batch(self, mm_hashes: list[str], modality: Modality | None = None) -> None: ...
    def check_prefetch_progress(self, req_id: str) -> bool: ...
    def has_local_embedding(self, mm_hash: str) -> bool: ...
    def get_pool_views(self, mm_hashes: list[str]) -> list[list[torch.Tensor] | None]: ...
    def release_pool_views(self, mm_hashes: list[str]) -> None: ...
    def get_stats(self) -> dict[str, Any]: ...
    async def batch_is_exist(self, mm_hashes: list[str]) -> list[bool]: ...
    def store_to_pool_async(
        self, mm_hashes: list[str], tensors: list[torch.Tensor], modality: Any = None
    ) -> list[tuple[EmbeddingCacheEntry, Any]]: ...
    def wait_store_to_pool(self, handles: list[tuple[EmbeddingCacheEntry, Any]]) -> None: ...
    def load_to_device_async(
        self, mm_hash: str, dst_tensor: torch.Tensor, dst_token_offset: int
    ) -> Any | None: ...
    def wait_load_to_device(self, handles: list[Any]) -> None: ...
