"""The exceptions mmkey raises; every one derives from `MMKeyError`."""

from __future__ import annotations

__all__ = [
    "CorruptEntry",
    "ForgedEntry",
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


class ForgedEntry(CorruptEntry):
    """A well-formed entry whose MAC does not verify under any secret of the reader's keyring.

    Also an entry without a MAC read with a keyring that does not accept unauthenticated
    entries. A `CorruptEntry`, so code that drops corrupt entries drops forged ones too.
    """


class StoreError(MMKeyError):
    """The backing store failed, timed out or could not be set up."""


class StoreClosed(StoreError):
    """The cache was closed (or never set up); open a new one."""
