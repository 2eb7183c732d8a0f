"""The exceptions mmkey raises; every one derives from `MMKeyError`."""

from __future__ import annotations

__all__ = [
    "CorruptEntry",
    "InvalidDigest",
    "InvalidKey",
    "MMKeyError",
    "StoreClosed",
    "StoreError",
]


class MMKeyError(Exception):
    """Base class of every error mmkey raises on purpose."""


class InvalidKey(MMKeyError, ValueError):
    """Key text, or a part of a key, that key format v1 does not allow."""


class InvalidDigest(InvalidKey):
    """A digest outside ``0 <= n < 2**bits`` for its scheme, or not a plain int."""


class CorruptEntry(MMKeyError):
    """A stored entry that does not verify: wrong magic, checksum, key, dtype or shape."""


class StoreError(MMKeyError):
    """The backing store failed, timed out or could not be set up."""


class StoreClosed(StoreError):
    """The cache was closed (or never set up); open a new one."""
