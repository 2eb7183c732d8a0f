"""`TieredCache`: a near cache in front of a far one, itself an `EmbeddingCache`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from mmkey.cache._guard import insert_args, key_texts, sync_cache
from mmkey.cache.protocol import CacheStats, EmbeddingCache
from mmkey.errors import StoreClosed, StoreError
from mmkey.keys import CacheKey

if TYPE_CHECKING:
    import torch

__all__ = ["TieredCache"]

_T = TypeVar("_T")


def _misses(n: int) -> list[torch.Tensor | None]:
    return [None] * n


def _refused(n: int) -> list[bool]:
    return [False] * n


class TieredCache:
    """Read-through, write-through tiers: `l1` (near, small) in front of `l2` (far, large).

    Reads try `l1`, then `l2`, and promote `l2` hits into `l1`; writes go to `l2` then
    `l1`; `prefetch` warms `l1` from `l2`. A tier raising `StoreError` counts as an error
    and serves misses. The tiers belong to this cache: `close` closes both. Tiers compose:
    either may itself be a `TieredCache`.
    """

    def __init__(self, l1: EmbeddingCache, l2: EmbeddingCache) -> None:
        if l1 is l2:
            raise ValueError("l1 and l2 must be two different caches")
        self.l1 = sync_cache(l1, "l1")
        self.l2 = sync_cache(l2, "l2")
        self._lock = threading.Lock()
        self._closed = False
        self._hits = self._misses = self._inserts = self._errors = 0

    def __repr__(self) -> str:
        return f"TieredCache(l1={self.l1!r}, l2={self.l2!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this TieredCache is closed; create a new one")

    def _tier(self, call: Callable[[], _T], fallback: _T) -> _T:
        try:
            return call()
        except StoreError:
            with self._lock:
                self._errors += 1
            return fallback

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held in either tier, in order."""
        self._check_open()
        key_texts(keys, "batch_is_exist")
        keys = list(keys)
        held = self._tier(lambda: self.l1.batch_is_exist(keys), _refused(len(keys)))
        missing = [i for i, h in enumerate(held) if not h]
        if missing:
            far = [keys[i] for i in missing]
            in_l2 = self._tier(lambda: self.l2.batch_is_exist(far), _refused(len(far)))
            for i, h in zip(missing, in_l2):
                held[i] = h
        return held

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Each key's tensor from `l1`, else from `l2` (then promoted to `l1`), else None."""
        self._check_open()
        key_texts(keys, "get_embeddings")
        keys = list(keys)
        results = self._tier(lambda: self.l1.get_embeddings(keys), _misses(len(keys)))
        missing = [i for i, t in enumerate(results) if t is None]
        if missing:
            far = [keys[i] for i in missing]
            found = self._tier(lambda: self.l2.get_embeddings(far), _misses(len(far)))
            promoted_keys: list[CacheKey] = []
            promoted: list[torch.Tensor] = []
            for i, tensor in zip(missing, found):
                if tensor is not None:
                    results[i] = tensor
                    promoted_keys.append(keys[i])
                    promoted.append(tensor)
            if promoted:
                self._tier(lambda: self.l1.insert_batch(promoted_keys, promoted), _refused(0))
        hits = sum(t is not None for t in results)
        with self._lock:
            self._hits += hits
            self._misses += len(results) - hits
        return results

    def insert_batch(
        self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]
    ) -> list[bool]:
        """Write each embedding to `l2`, then `l1`; whether each key is held in either."""
        self._check_open()
        insert_args(keys, embeddings)
        keys, tensors = list(keys), list(embeddings)
        in_l2 = self._tier(lambda: self.l2.insert_batch(keys, tensors), _refused(len(keys)))
        in_l1 = self._tier(lambda: self.l1.insert_batch(keys, tensors), _refused(len(keys)))
        held = [a or b for a, b in zip(in_l1, in_l2)]
        with self._lock:
            self._inserts += sum(held)
        return held

    def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """Copy the keys held only in `l2` into `l1`; how many are now held in `l1`."""
        self._check_open()
        key_texts(keys, "prefetch")
        keys = list(keys)
        near = self._tier(lambda: self.l1.batch_is_exist(keys), _refused(len(keys)))
        far = [key for key, h in zip(keys, near) if not h]
        if not far:
            return sum(near)
        found = self._tier(lambda: self.l2.get_embeddings(far), _misses(len(far)))
        warm_keys = [key for key, t in zip(far, found) if t is not None]
        warm = [t for t in found if t is not None]
        if not warm:
            return sum(near)
        stored = self._tier(lambda: self.l1.insert_batch(warm_keys, warm), _refused(0))
        return sum(near) + sum(stored)

    def stats(self) -> CacheStats:
        """Hits, misses and inserts of this cache; the rest summed over both tiers."""
        self._check_open()
        s1 = self._tier(self.l1.stats, CacheStats())
        s2 = self._tier(self.l2.stats, CacheStats())
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                inserts=self._inserts,
                evictions=s1.evictions + s2.evictions,
                corrupt=s1.corrupt + s2.corrupt,
                errors=self._errors + s1.errors + s2.errors,
                forged=s1.forged + s2.forged,
                skipped=s1.skipped + s2.skipped,
                bytes_held=s1.bytes_held + s2.bytes_held,
                entries=s1.entries + s2.entries,
            )

    def close(self) -> None:
        """Close both tiers; later calls (but `close`) raise `StoreClosed`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.l1.close()
        finally:
            self.l2.close()
