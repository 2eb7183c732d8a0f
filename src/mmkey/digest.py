"""Digests (`MMHash`), the hash schemes that make them, and media modalities."""

from __future__ import annotations

import enum
from typing import NewType

from mmkey.errors import InvalidDigest

__all__ = ["HashScheme", "MMHash", "Modality", "mm_hash"]

MMHash = NewType("MMHash", int)
"""A content digest: an unsigned int below ``2**128``. Never a store key by itself."""

_MAX_BITS = 128


class HashScheme(enum.Enum):
    """How a digest was computed; part of every key, so schemes never mix."""

    BLAKE3 = "blake3"
    """128-bit BLAKE3 over dtype, shape and bytes: collision resistant, the default."""
    XXH3 = "xxh3"
    """128-bit XXH3 over dtype, shape and bytes: fastest, for trusted input only."""
    SGLANG = "sglang"
    """64-bit: SGLang's CPU ``tensor_hash`` bit for bit, to migrate a fleet without a cold cache."""
    ID = "id"
    """128-bit BLAKE3 of a serving stack's opaque identifier text (e.g. vLLM's ``mm_hash``),
    made by `mmkey.identifier_digest`; it names content the stack hashed, never a tensor."""

    @property
    def bits(self) -> int:
        """Width of this scheme's digests in bits."""
        return 64 if self is HashScheme.SGLANG else 128

    @property
    def hashes_content(self) -> bool:
        """Whether `hash_tensor` / `hash_bytes` compute digests of this scheme (all but ID)."""
        return self is not HashScheme.ID

    @property
    def hex_width(self) -> int:
        """Number of hex digits of this scheme's digests in a key."""
        return self.bits // 4


class Modality(enum.Enum):
    """The kind of media an embedding was computed from."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


def mm_hash(n: int, scheme: HashScheme | None = None) -> MMHash:
    """Check that ``n`` is a digest (``0 <= n < 2**128``, or the scheme's width) and type it.

    Raises `TypeError` for anything that is not an int, and `InvalidDigest` for a
    `bool` or an int out of range.
    """
    value: object = n  # callers without mypy may pass anything
    if not isinstance(value, int):
        raise TypeError(
            f"mm_hash() takes an int digest, got {type(value).__name__}; "
            "convert with int(x) (or parse hex text with int(s, 16)) first"
        )
    if isinstance(n, bool):
        raise InvalidDigest(f"a bool is not a digest (got {n!r}); pass the int digest itself")
    bits = _MAX_BITS if scheme is None else scheme.bits
    if n < 0 or n >> bits:
        what = "128-bit" if scheme is None else f"{bits}-bit {scheme.value}"
        raise InvalidDigest(
            f"digest {n} is outside the {what} range 0 <= n < 2**{bits}; "
            "mask or re-hash it instead of truncating silently"
        )
    return MMHash(int(n))
