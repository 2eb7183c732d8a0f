"""The strict cache protocol every embedding cache implements, sync and async, and the
claims (single-flight) that a shared cache may add to it."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

from mmkey.keys import CacheKey

if TYPE_CHECKING:
    import torch

__all__ = [
    "AsyncClaimingCache",
    "AsyncEmbeddingCache",
    "CacheStats",
    "Claim",
    "ClaimingCache",
    "EmbeddingCache",
]


@attrs.frozen(slots=True)
class CacheStats:
    """Counters of one cache since it was created; a snapshot, never updated in place."""

    hits: int = 0
    """Keys read and returned as a verified tensor."""
    misses: int = 0
    """Keys read and not found (corrupt entries and store errors included)."""
    inserts: int = 0
    """Entries written."""
    evictions: int = 0
    """Entries dropped to stay within the budget."""
    corrupt: int = 0
    """Entries that failed verification on read (served as misses)."""
    errors: int = 0
    """Store calls that failed or timed out (served as misses or failed inserts)."""
    forged: int = 0
    """Entries whose authentication failed on read (served as misses, counted apart from
    `corrupt`): written without the fleet's secret, or altered after it was written."""
    skipped: int = 0
    """Calls answered without asking the store (served as misses or failed inserts): the
    store was known to be down, or every copy of an entry sat on a failed holder."""
    squatted: int = 0
    """Keys written over a put session of another client that reserved them, while the store
    did not hold them, past the wait for a write in progress (a squat, or a writer that died
    mid-write); counted apart from `skipped`."""
    unsigned: int = 0
    """Of `forged`: entries without a MAC, read outside a migration window."""
    unknown_key: int = 0
    """Of `forged`: entries naming a secret the keyring does not hold."""
    expired: int = 0
    """Of `forged`: entries made with a previous secret past its not-after time."""
    bad_mac: int = 0
    """Of `forged`: entries whose MAC (or header, key or size) does not verify."""
    unsigned_served: int = 0
    """Entries without a MAC served during a migration window (``MMKEY_ENTRY_AUTH=migrate``)."""
    oversized: int = 0
    """Entries left unread for being larger than the reader could use (of `forged` under a
    keyring, of `corrupt` without one)."""
    claims_won: int = 0
    """Keys this cache claimed before encoding them (single-flight): no other claimant
    encoded them meanwhile."""
    waits_served: int = 0
    """Keys claimed elsewhere whose entry landed within the wait bound."""
    waits_timed_out: int = 0
    """Keys claimed elsewhere whose entry did not land within the wait bound (the claimant
    died or squats, the encode is slower than the bound, or the store failed): encoded here."""
    coalesced: int = 0
    """Keys served by another claimant's encode after a wait: encodes saved by single-flight."""
    bytes_held: int | None = None
    """Encoded bytes this cache holds, or ``None`` where it cannot know: a client of a remote
    store, whose entries live in other processes, says so instead of reporting 0."""
    entries: int | None = None
    """Entries this cache holds, or ``None`` where it cannot know (see `bytes_held`)."""

    @property
    def hit_rate(self) -> float:
        """Hits over reads, 0.0 before any read."""
        reads = self.hits + self.misses
        return self.hits / reads if reads else 0.0


@runtime_checkable
class EmbeddingCache(Protocol):
    """A cache of embeddings keyed by `CacheKey` objects only, never by digests or text.

    Reads never return a wrong tensor: anything that does not verify is a miss.
    Store failures are misses (reads) or ``False`` (writes), never exceptions.
    """

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held, in order."""
        ...

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The verified embedding of each key, or None for a miss, in order."""
        ...

    def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        """Store one embedding per key; whether each is held afterwards."""
        ...

    def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """Bring the keys as close as this cache can; how many are now held nearby."""
        ...

    def stats(self) -> CacheStats:
        """A snapshot of this cache's counters."""
        ...

    def close(self) -> None:
        """Release the cache; any later call raises `StoreClosed`. Idempotent."""
        ...


@runtime_checkable
class AsyncEmbeddingCache(Protocol):
    """The asyncio counterpart of `EmbeddingCache`: the same methods, awaitable."""

    async def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held, in order."""
        ...

    async def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The verified embedding of each key, or None for a miss, in order."""
        ...

    async def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        """Store one embedding per key; whether each is held afterwards."""
        ...

    async def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """Bring the keys as close as this cache can; how many are now held nearby."""
        ...

    def stats(self) -> CacheStats:
        """A snapshot of this cache's counters."""
        ...

    async def close(self) -> None:
        """Release the cache; any later call raises `StoreClosed`. Idempotent."""
        ...


class Claim(enum.Enum):
    """What `ClaimingCache.claim` answered for one key."""

    WON = "won"
    """This caller holds the key's claim: encode it, insert it, then `ClaimingCache.release` it
    (also when the encode fails)."""
    HELD = "held"
    """Another claimant (another process, or another caller of this cache) is encoding the key:
    `ClaimingCache.wait_for_embeddings` waits for its entry, bounded."""
    UNCLAIMED = "unclaimed"
    """No claim either way (claims are off, or the store did not answer): encode it."""


@runtime_checkable
class ClaimingCache(EmbeddingCache, Protocol):
    """An `EmbeddingCache` whose clients can claim a key before encoding it, so that of many
    clients missing one key at once, one encodes and the others wait for its entry (bounded)."""

    @property
    def claim_wait(self) -> float:
        """Seconds `wait_for_embeddings` waits at most; 0.0 when claims are off."""
        ...

    def claim(self, keys: Sequence[CacheKey]) -> list[Claim]:
        """Claim each key before encoding it; what each claim answered, in order."""
        ...

    def release(self, keys: Sequence[CacheKey]) -> None:
        """Give up the claims this cache won on ``keys`` (after inserting them, or on failure)."""
        ...

    def wait_for_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Wait at most `claim_wait` seconds for the entries of keys claimed elsewhere; the
        verified embedding of each that landed, or None (encode it), in order."""
        ...


@runtime_checkable
class AsyncClaimingCache(AsyncEmbeddingCache, Protocol):
    """The asyncio counterpart of `ClaimingCache`."""

    @property
    def claim_wait(self) -> float:
        """Seconds `wait_for_embeddings` waits at most; 0.0 when claims are off."""
        ...

    async def claim(self, keys: Sequence[CacheKey]) -> list[Claim]:
        """Claim each key before encoding it; what each claim answered, in order."""
        ...

    async def release(self, keys: Sequence[CacheKey]) -> None:
        """Give up the claims this cache won on ``keys``."""
        ...

    async def wait_for_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Wait, bounded, for the entries of keys claimed elsewhere; each verified embedding or None."""
        ...
