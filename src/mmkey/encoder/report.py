"""What one cache-aware encode did: `EncodeReport` counters and `EncodeResult`."""

from __future__ import annotations

import attrs
import torch

from mmkey.keys import EmbeddingKey

__all__ = ["EncodeReport", "EncodeResult"]


@attrs.frozen(slots=True)
class EncodeReport:
    """Counters of one `encode_with_cache` call (or, added with ``+``, of many).

    Cache failures never fail an encode: they are swallowed, the items are encoded,
    and `cache_errors` counts them. Every time is wall-clock seconds.
    """

    items: int = 0
    """Items in the request(s)."""
    unique: int = 0
    """Distinct items (by key); duplicates within a request are looked up and encoded once."""
    hits: int = 0
    """Distinct items served from the cache."""
    encoded: int = 0
    """Distinct items passed to the encoder."""
    coalesced: int = 0
    """Distinct items another claimant encoded while this call waited (single-flight): encodes
    saved. Not counted in `hits`."""
    stale: int = 0
    """Items the cache said it held but then did not return (evicted, corrupt): encoded."""
    cache_errors: int = 0
    """Cache calls that raised or returned malformed results; swallowed, items encoded."""
    inserted: int = 0
    """Encoded items the cache holds afterwards."""
    insert_failures: int = 0
    """Encoded items the cache did not take (refused, too large, or the insert failed)."""
    hashed_bytes: int = 0
    """Feature bytes hashed."""
    hash_seconds: float = 0.0
    """Time spent splitting and hashing the features."""
    lookup_seconds: float = 0.0
    """Time spent in ``batch_is_exist`` and ``get_embeddings``."""
    encode_seconds: float = 0.0
    """Time spent in the encoder."""
    insert_seconds: float = 0.0
    """Time spent in ``insert_batch``."""
    wait_seconds: float = 0.0
    """Time spent claiming misses and waiting for items claimed elsewhere."""

    @property
    def duplicates(self) -> int:
        """Items that repeated an earlier item of the same request."""
        return self.items - self.unique

    @property
    def saved(self) -> int:
        """Items not sent to the encoder, thanks to the cache, single-flight or de-duplication."""
        return self.items - self.encoded

    @property
    def hit_rate(self) -> float:
        """Cache hits over distinct items looked up; 0.0 when nothing was looked up."""
        return self.hits / self.unique if self.unique else 0.0

    def __add__(self, other: EncodeReport) -> EncodeReport:
        if not isinstance(other, EncodeReport):
            return NotImplemented
        return EncodeReport(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in attrs.fields(EncodeReport)}
        )


@attrs.frozen(slots=True)
class EncodeResult:
    """The embeddings and keys of a request, one per item in input order, and what it took."""

    embeddings: list[torch.Tensor]
    """One embedding per item, in input order; duplicates of an item share one tensor."""
    keys: list[EmbeddingKey]
    """The cache key of each item, in input order (what a prefill worker is sent)."""
    report: EncodeReport
    """The counters of this call."""
