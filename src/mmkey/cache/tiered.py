"""`TieredCache`: a near cache in front of a far one, itself an `EmbeddingCache`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from mmkey.cache._guard import insert_args, key_texts, sync_cache
from mmkey.cache.health import CacheHealth, health_of
from mmkey.cache.protocol import CacheStats, Claim, ClaimingCache, EmbeddingCache
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


class _Read:
    """A read of the far tier in flight: the keys written into `l1` since it began."""

    __slots__ = ("overtaken",)

    def __init__(self) -> None:
        self.overtaken: set[str] = set()


class _NearWrites:
    """Orders the writes into the near tier so that a promotion never lands on a newer value.

    Writes into `l1` (inserts and promotions) run one at a time under `writing`. Reads of
    `l2` register their keys for their duration under `reading`; an insert marks the keys it
    writes as overtaken in every registered read, and a promotion (inside `writing`) skips
    the keys its read had overtaken. State is kept only for reads in flight.
    """

    def __init__(self) -> None:
        self._near = threading.Lock()  # held across each write into l1
        self._registry = threading.Lock()  # guards _reads; never held across a tier call
        self._reads: dict[str, list[_Read]] = {}

    @contextlib.contextmanager
    def reading(self, texts: Sequence[str]) -> Iterator[_Read]:
        """Register a far read of `texts` for the block's duration."""
        read = _Read()
        distinct = set(texts)
        with self._registry:
            for text in distinct:
                self._reads.setdefault(text, []).append(read)
        try:
            yield read
        finally:
            with self._registry:
                for text in distinct:
                    reads = self._reads[text]
                    reads[:] = [r for r in reads if r is not read]
                    if not reads:
                        del self._reads[text]

    @contextlib.contextmanager
    def writing(self, texts: Sequence[str]) -> Iterator[None]:
        """Hold the near tier for one write of `texts`, overtaking the reads in flight."""
        with self._near:
            with self._registry:
                for text in texts:
                    for read in self._reads.get(text, ()):
                        read.overtaken.add(text)
            yield


class TieredCache:
    """Read-through, write-through tiers: `l1` (near, small) in front of `l2` (far, large).

    Reads try `l1`, then `l2`, and promote `l2` hits into `l1`; writes go to `l2` then
    `l1`; `prefetch` warms `l1` from `l2`. A promotion never overwrites a newer write: a
    read of `l2` that overlapped an `insert_batch` of the same key does not promote (its
    value may be older), and writes into `l1` are ordered one at a time. A tier raising
    `StoreError` counts as an error and serves misses. The tiers belong to this cache:
    `close` closes both. Tiers compose: either may itself be a `TieredCache`.
    """

    l1: EmbeddingCache
    """The near tier: read first, written last, filled by promotions."""
    l2: EmbeddingCache
    """The far tier: read on an `l1` miss, written first."""

    def __init__(self, l1: EmbeddingCache, l2: EmbeddingCache) -> None:
        if l1 is l2:
            raise ValueError("l1 and l2 must be two different caches")
        self.l1 = sync_cache(l1, "l1")
        self.l2 = sync_cache(l2, "l2")
        self._lock = threading.Lock()
        self._near_writes = _NearWrites()
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

    def _per_key(self, call: Callable[[], list[_T]], fallback: list[_T]) -> list[_T]:
        """`_tier` for an answer with one item per key. An answer for a different number of
        keys breaks the protocol: it counts as a tier error and `fallback` is used, so no
        answer lands on another key."""
        answer = self._tier(call, fallback)
        if len(answer) == len(fallback):
            return answer
        with self._lock:
            self._errors += 1
        return fallback

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held in either tier, in order."""
        self._check_open()
        key_texts(keys, "batch_is_exist")
        keys = list(keys)
        held = self._per_key(lambda: self.l1.batch_is_exist(keys), _refused(len(keys)))
        missing = [i for i, h in enumerate(held) if not h]
        if missing:
            far = [keys[i] for i in missing]
            in_l2 = self._per_key(lambda: self.l2.batch_is_exist(far), _refused(len(far)))
            for i, h in zip(missing, in_l2, strict=True):
                held[i] = h
        return held

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Each key's tensor from `l1`, else from `l2` (then promoted to `l1`), else None."""
        self._check_open()
        texts = key_texts(keys, "get_embeddings")
        keys = list(keys)
        results = self._per_key(lambda: self.l1.get_embeddings(keys), _misses(len(keys)))
        missing = [i for i, t in enumerate(results) if t is None]
        if missing:
            found, _ = self._read_far([keys[i] for i in missing], [texts[i] for i in missing])
            for i, tensor in zip(missing, found, strict=True):
                if tensor is not None:
                    results[i] = tensor
        hits = sum(t is not None for t in results)
        with self._lock:
            self._hits += hits
            self._misses += len(results) - hits
        return results

    def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        """Write each embedding to `l2`, then `l1`; whether each key is held in either."""
        self._check_open()
        texts, _ = insert_args(keys, embeddings)
        keys, tensors = list(keys), list(embeddings)
        in_l2 = self._per_key(lambda: self.l2.insert_batch(keys, tensors), _refused(len(keys)))
        with self._near_writes.writing(texts):
            in_l1 = self._per_key(lambda: self.l1.insert_batch(keys, tensors), _refused(len(keys)))
        held = [a or b for a, b in zip(in_l1, in_l2, strict=True)]
        with self._lock:
            self._inserts += sum(held)
        return held

    def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """Copy the keys held only in `l2` into `l1`; how many are now held in `l1`.

        A key written by a concurrent `insert_batch` is left to that write (not counted).
        """
        self._check_open()
        texts = key_texts(keys, "prefetch")
        keys = list(keys)
        near = self._per_key(lambda: self.l1.batch_is_exist(keys), _refused(len(keys)))
        far = [i for i, h in enumerate(near) if not h]
        if not far:
            return sum(near)
        _, promoted = self._read_far([keys[i] for i in far], [texts[i] for i in far])
        return sum(near) + promoted

    # -- single-flight: the far tier's claims ---------------------------------------------

    @property
    def claim_wait(self) -> float:
        """`l2`'s ``claim_wait`` where it supports claims (`ClaimingCache`), else 0.0 (off)."""
        far = self.l2
        return far.claim_wait if isinstance(far, ClaimingCache) else 0.0

    def claim(self, keys: Sequence[CacheKey]) -> list[Claim]:
        """`l2`'s claims of the keys (`Claim.UNCLAIMED` where it has none, or fails)."""
        self._check_open()
        key_texts(keys, "claim")
        keys, far = list(keys), self.l2
        unclaimed = [Claim.UNCLAIMED] * len(keys)
        if not isinstance(far, ClaimingCache):
            return unclaimed
        return self._per_key(lambda: far.claim(keys), unclaimed)

    def release(self, keys: Sequence[CacheKey]) -> None:
        """Release `l2`'s claims of the keys."""
        self._check_open()
        key_texts(keys, "release")
        keys, far = list(keys), self.l2
        if isinstance(far, ClaimingCache):
            self._tier(lambda: far.release(keys), None)

    def wait_for_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """`l2`'s wait for keys claimed elsewhere; what landed is promoted into `l1`."""
        self._check_open()
        key_texts(keys, "wait_for_embeddings")
        keys, far = list(keys), self.l2
        if not isinstance(far, ClaimingCache):
            return _misses(len(keys))
        found = self._per_key(lambda: far.wait_for_embeddings(keys), _misses(len(keys)))
        landed = [(k, v) for k, v in zip(keys, found, strict=True) if v is not None]
        if landed:
            with self._near_writes.writing([k.to_key() for k, _ in landed]):
                self._per_key(
                    lambda: self.l1.insert_batch([k for k, _ in landed], [v for _, v in landed]),
                    _refused(len(landed)),
                )
        return found

    def _read_far(self, keys: list[CacheKey], texts: list[str]) -> tuple[list[torch.Tensor | None], int]:
        """`l2`'s answer for `keys`, its hits promoted into `l1`; how many promotions held.

        A key written by `insert_batch` after this read began is not promoted: the value
        read may predate that write, and the write has put its own value in `l1`.
        """
        with self._near_writes.reading(texts) as read:
            found = self._per_key(lambda: self.l2.get_embeddings(keys), _misses(len(keys)))
            hits = [(k, t, v) for k, t, v in zip(keys, texts, found, strict=True) if v is not None]
            if not hits:
                return found, 0
            with self._near_writes.writing(()):
                promote = [(k, v) for k, t, v in hits if t not in read.overtaken]
                if not promote:
                    return found, 0
                promoted_keys = [k for k, _ in promote]
                promoted = [v for _, v in promote]
                held = self._per_key(
                    lambda: self.l1.insert_batch(promoted_keys, promoted), _refused(len(promoted))
                )
        return found, sum(held)

    def health(self) -> CacheHealth:
        """Both tiers' `CacheHealth` merged (tiers without a store report nothing to merge)."""
        report = CacheHealth()
        for tier in (self.l1, self.l2):
            tier_report = health_of(tier)
            if tier_report is not None:
                report = report.merged(tier_report)
        return report

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
                squatted=s1.squatted + s2.squatted,
                unsigned=s1.unsigned + s2.unsigned,
                unknown_key=s1.unknown_key + s2.unknown_key,
                expired=s1.expired + s2.expired,
                bad_mac=s1.bad_mac + s2.bad_mac,
                unsigned_served=s1.unsigned_served + s2.unsigned_served,
                oversized=s1.oversized + s2.oversized,
                claims_won=s1.claims_won + s2.claims_won,
                waits_served=s1.waits_served + s2.waits_served,
                waits_timed_out=s1.waits_timed_out + s2.waits_timed_out,
                coalesced=s1.coalesced + s2.coalesced,
                bytes_held=_known_sum(s1.bytes_held, s2.bytes_held),
                entries=_known_sum(s1.entries, s2.entries),
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


def _known_sum(near: int | None, far: int | None) -> int | None:
    """The sum over both tiers, or ``None`` when either tier does not know its own."""
    return None if near is None or far is None else near + far
