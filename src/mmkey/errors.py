"""The exceptions mmkey raises; every one derives from `MMKeyError` and is defined here.

The tree (a second base, where a class has one, in brackets; ``except ValueError`` and
``except RuntimeError`` keep catching those)::

    MMKeyError
        InvalidKey [ValueError]
            InvalidDigest
        CorruptEntry
            ForgedEntry
        StoreError
            StoreClosed
            CallTimeout
            TransferFailed
        SGLangConfigError [ValueError]
        UnknownBuffer [ValueError]
        MasterStartError [RuntimeError]
        FleetStartError [RuntimeError]
        ShapingUnavailable [RuntimeError]

The modules that raise one re-export it where it was imported from before
(``mmkey.integrations.sglang``, ``mmkey.testing.fleet``, ...); the class is the same object.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "CallTimeout",
    "CorruptEntry",
    "FleetStartError",
    "ForgedEntry",
    "ForgedReason",
    "InvalidDigest",
    "InvalidKey",
    "MMKeyError",
    "MasterStartError",
    "SGLangConfigError",
    "ShapingUnavailable",
    "StoreClosed",
    "StoreError",
    "TransferFailed",
    "UnknownBuffer",
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


class CallTimeout(StoreError):
    """A store call did not finish within its timeout (it may still finish later)."""


class TransferFailed(StoreError):
    """A transfer reached the master but not the holder (Mooncake's TRANSFER_FAIL codes)."""


class SGLangConfigError(MMKeyError, ValueError):
    """The SGLang integration is switched on but cannot run as configured; says the fix."""


class UnknownBuffer(MMKeyError, ValueError):
    """An SGLang transfer names memory outside every registered pool, or not whole rows of one."""


class MasterStartError(MMKeyError, RuntimeError):
    """The testing kit's master did not become ready; the message carries the tail of its log."""


class FleetStartError(MMKeyError, RuntimeError):
    """A testing-kit holder (or the test network) did not come up; the message carries its log tail."""


class ShapingUnavailable(MMKeyError, RuntimeError):
    """The kernel lacks the queueing discipline a test fleet asked for (``netem`` in many VMs)."""
