"""The exceptions mmkey raises; every one derives from `MMKeyError`."""

from __future__ import annotations

from typing import Literal

__all__ = [
    "CorruptEntry",
    "ForgedEntry",
    "ForgedReason",
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


ForgedReason = Literal["unsigned", "unknown_key", "expired", "bad_mac"]
"""Why a keyring refused an entry: it carries no MAC (outside a migration window), names a
secret the keyring does not hold, was made with an expired previous secret, or fails its
MAC (or its checksum, its header or its key: every refusal under a keyring)."""


class ForgedEntry(CorruptEntry):
    """An entry a reader with a keyring refused: its MAC does not verify under a secret of
    the keyring that has not expired, or it carries none (see ``reason``).

    A `CorruptEntry`, so code that drops corrupt entries drops forged ones too.
    """

    def __init__(self, message: str, *, reason: ForgedReason = "bad_mac") -> None:
        super().__init__(message)
        self.reason: ForgedReason = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), self.args, {"reason": self.reason})


class StoreError(MMKeyError):
    """The backing store failed, timed out or could not be set up."""


class StoreClosed(StoreError):
    """The cache was closed (or never set up); open a new one."""
