"""mmkey: typed, round-tripping cache keys and strict embedding caches for multimodal serving.

A digest is an `MMHash`; the only road from it to a store key is an `EmbeddingKey` and
its `~EmbeddingKey.to_key`; every cache takes `CacheKey` objects only. Importing mmkey imports
neither torch nor mooncake: they load when a function needs them, and the Mooncake
client (`MooncakeCache`) loads on first use of its name.

This module re-exports the public names of the core (digests, keys, hashing, errors,
entries, caches); the encoder, metrics, integrations, testing kit and command line are
imported by their own names. The layers, and what each package may import, are in
``docs/architecture.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmkey._lazy import lazy_exports
from mmkey.cache.aio import AsyncCache
from mmkey.cache.memory import MemoryCache
from mmkey.cache.mooncake.config import MooncakeConfig
from mmkey.cache.protocol import AsyncEmbeddingCache, CacheStats, EmbeddingCache
from mmkey.cache.tiered import TieredCache
from mmkey.digest import HashScheme, MMHash, Modality, mm_hash
from mmkey.entry.auth import EntryKeyring, EntrySecret
from mmkey.errors import (
    CorruptEntry,
    ForgedEntry,
    InvalidDigest,
    InvalidKey,
    MMKeyError,
    StoreClosed,
    StoreError,
)
from mmkey.hashing import hash_bytes, hash_tensor, identifier_digest
from mmkey.keys import CacheKey, EmbeddingKey

if TYPE_CHECKING:
    from mmkey.cache.mooncake import MooncakeCache

__version__ = "0.1.0.dev0"

__all__ = [
    "AsyncCache",
    "AsyncEmbeddingCache",
    "CacheKey",
    "CacheStats",
    "CorruptEntry",
    "EmbeddingCache",
    "EmbeddingKey",
    "EntryKeyring",
    "EntrySecret",
    "ForgedEntry",
    "HashScheme",
    "InvalidDigest",
    "InvalidKey",
    "MMHash",
    "MMKeyError",
    "MemoryCache",
    "Modality",
    "MooncakeCache",
    "MooncakeConfig",
    "StoreClosed",
    "StoreError",
    "TieredCache",
    "hash_bytes",
    "hash_tensor",
    "identifier_digest",
    "mm_hash",
]


if not TYPE_CHECKING:
    # hidden from type checkers, so a misspelt name stays a type error; the Mooncake client
    # (its transport threads and exit hook) loads when first named
    __getattr__, __dir__ = lazy_exports(__name__, globals(), {"MooncakeCache": "cache.mooncake"}, __all__)
