"""A model-based test for any `EmbeddingCache`: a hypothesis state machine against a dict.

Use it from a test module::

    TestMyCache = make_cache_state_machine(lambda: MyCache(...), evicts=True).TestCase

The machine writes, reads, checks existence, prefetches and mutates tensors on a small
pool of keys (keys that differ only in namespace, modality, scheme or digest), and checks
every answer against the model: a read returns nothing or exactly a value written under
that key since it was last successfully written, never another key's value and never an
older one. Each example starts from fresh keys, so a persistent store can be reused.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mmkey.cache.protocol import CacheStats, EmbeddingCache
from mmkey.digest import HashScheme, Modality, mm_hash
from mmkey.errors import StoreClosed
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    import torch

__all__ = ["make_cache_state_machine", "same_tensor"]

_RUNS = itertools.count()
_DTYPES = ("float32", "bfloat16", "int64", "uint8", "float16", "bool")


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (so NaNs and signed zeros compare exactly)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _key_pool(run: int) -> list[EmbeddingKey]:
    namespace = f"model-test-{run}"
    return [
        EmbeddingKey(namespace, Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1)),
        EmbeddingKey(namespace, Modality.IMAGE, HashScheme.BLAKE3, mm_hash(2)),
        EmbeddingKey(namespace, Modality.VIDEO, HashScheme.BLAKE3, mm_hash(1)),
        EmbeddingKey(namespace, Modality.IMAGE, HashScheme.XXH3, mm_hash(1)),
        EmbeddingKey(namespace, Modality.IMAGE, HashScheme.SGLANG, mm_hash(1)),
        EmbeddingKey(namespace + "-b", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1)),
    ]


def _value(serial: int, dtype_name: str, numel: int) -> torch.Tensor:
    """A tensor whose bytes carry `serial`, so stale and foreign values are told apart."""
    import torch

    dtype = getattr(torch, dtype_name)
    base = torch.arange(numel, dtype=torch.int64) * 7 + serial * 1000
    if dtype == torch.bool:
        return (base % 3 == serial % 3).reshape(-1)
    if dtype == torch.uint8:
        return (base % 251).to(torch.uint8)
    return base.to(dtype).reshape(-1) if numel != 1 else base.to(dtype).reshape(())


def make_cache_state_machine(
    factory: Callable[[], EmbeddingCache],
    *,
    evicts: bool = True,
    max_bytes: int | None = None,
    max_numel: int = 600,
) -> type[RuleBasedStateMachine]:
    """A state machine class checking caches made by ``factory`` against a dict model.

    ``evicts``: the cache may drop entries (then reads may miss; without it, every key
    written successfully must read back). `max_bytes`: ``stats().bytes_held`` must stay
    within it. ``max_numel``: the largest tensor written, in elements. Run it with
    ``TestX = make_cache_state_machine(...).TestCase``.
    """
    indexes = st.lists(st.integers(0, 5), min_size=0, max_size=5)
    values = st.tuples(st.sampled_from(_DTYPES), st.integers(0, max_numel))

    class CacheModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.cache = factory()
            self.keys = _key_pool(next(_RUNS))
            self.serials = itertools.count(1)
            self.allowed: dict[int, list[torch.Tensor]] = {}
            """Per key index, the values a read may return (besides a miss)."""
            self.sure: set[int] = set()
            """Key indexes that must be held (only when the cache does not evict)."""
            self.last = CacheStats()

        def _check_read(self, index: int, got: torch.Tensor | None) -> None:
            if got is None:
                assert evicts or index not in self.sure, f"key {index} was written, read missed"
                return
            allowed = self.allowed.get(index, [])
            assert any(same_tensor(got, v) for v in allowed), (
                f"key {index} returned a value never written under it (stale or foreign): "
                f"{got.dtype} {tuple(got.shape)}"
            )

        @rule(picks=indexes, data=st.data())
        def insert(self, picks: list[int], data: st.DataObject) -> None:
            tensors = [_value(next(self.serials), *data.draw(values)) for _ in picks]
            held = self.cache.insert_batch([self.keys[i] for i in picks], tensors)
            assert isinstance(held, list)  # for callers without mypy
            assert len(held) == len(picks)
            written: dict[int, list[torch.Tensor]] = {}
            for i, tensor in zip(picks, tensors, strict=True):
                written.setdefault(i, []).append(tensor.clone())
            for i, ok in zip(picks, held, strict=True):
                if ok:
                    self.allowed[i] = written[i]
                    if not evicts:
                        self.sure.add(i)
                else:
                    self.sure.discard(i)
            for tensor in tensors:  # the caller reuses its buffers: the cache must not care
                _scribble(tensor)

        @rule(picks=indexes)
        def get(self, picks: list[int]) -> None:
            got = self.cache.get_embeddings([self.keys[i] for i in picks])
            assert isinstance(got, list)  # for callers without mypy
            assert len(got) == len(picks)
            for i, tensor in zip(picks, got, strict=True):
                self._check_read(i, tensor)
            stats = self.cache.stats()
            hits = sum(t is not None for t in got)
            assert stats.hits - self.last.hits == hits
            assert stats.misses - self.last.misses == len(picks) - hits
            for tensor in got:  # mutating what was read must not reach the cache
                if tensor is not None:
                    _scribble(tensor)
            for i, tensor in zip(
                picks, self.cache.get_embeddings([self.keys[i] for i in picks]), strict=True
            ):
                self._check_read(i, tensor)

        @rule(picks=indexes)
        def exists(self, picks: list[int]) -> None:
            keys = [self.keys[i] for i in picks]
            held = self.cache.batch_is_exist(keys)
            assert isinstance(held, list)  # for callers without mypy
            assert len(held) == len(picks)
            for i, h in zip(picks, held, strict=True):
                assert h or evicts or i not in self.sure, f"key {i} was written, exists says no"
                assert not h or i in self.allowed, f"key {i} was never written, exists says yes"
            for i, h, got in zip(picks, held, self.cache.get_embeddings(keys), strict=True):
                assert got is not None or not h, f"key {i} exists but reads as a miss"
                self._check_read(i, got)

        @rule(picks=indexes)
        def prefetch(self, picks: list[int]) -> None:
            count = self.cache.prefetch([self.keys[i] for i in picks])
            assert isinstance(count, int)  # for callers without mypy
            assert 0 <= count <= len(picks)
            assert count <= sum(i in self.allowed for i in picks), "prefetched unwritten keys"

        @invariant()
        def counters_are_sane(self) -> None:
            stats = self.cache.stats()
            assert isinstance(stats, CacheStats)
            assert stats.corrupt == 0 and stats.errors == 0
            assert stats.hits >= self.last.hits and stats.misses >= self.last.misses
            assert stats.bytes_held is None or stats.bytes_held >= 0
            assert stats.entries is None or stats.entries >= 0
            if max_bytes is not None:
                assert stats.bytes_held is not None, "a cache with a byte budget knows what it holds"
                assert stats.bytes_held <= max_bytes, f"{stats.bytes_held} > budget {max_bytes}"
            self.last = stats

        def teardown(self) -> None:
            self.cache.close()
            self.cache.close()
            with pytest.raises(StoreClosed):
                self.cache.get_embeddings(self.keys[:1])
            with pytest.raises(StoreClosed):
                self.cache.insert_batch(self.keys[:1], [_value(0, "float32", 1)])

    return CacheModel


def _scribble(t: torch.Tensor) -> None:
    """Flip the lowest bit of `t`'s first byte in place (a valid bool stays valid)."""
    import torch

    if t.numel():
        t.reshape(-1).view(torch.uint8)[0] ^= 1
