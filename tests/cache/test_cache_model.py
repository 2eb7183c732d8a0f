"""Every cache implementation against the dict model of `mmkey.testing.cache_model`."""

from __future__ import annotations

import hashlib

from hypothesis import settings

from mmkey import EntryKeyring, MemoryCache, TieredCache
from mmkey.testing.cache_model import make_cache_state_machine

MODEL_SETTINGS = settings(max_examples=100, stateful_step_count=30)

SMALL = 2048
"""A budget of a few entries, so eviction and refusal (an entry over budget) are frequent."""

TestMemoryCacheEvicting = make_cache_state_machine(
    lambda: MemoryCache(SMALL), evicts=True, max_bytes=SMALL, max_numel=700
).TestCase
TestMemoryCacheEvicting.settings = MODEL_SETTINGS

TestMemoryCacheRoomy = make_cache_state_machine(
    lambda: MemoryCache(1 << 22), evicts=False, max_bytes=1 << 22
).TestCase
TestMemoryCacheRoomy.settings = MODEL_SETTINGS

TestTieredOverRoomyL2 = make_cache_state_machine(
    lambda: TieredCache(MemoryCache(SMALL), MemoryCache(1 << 22)), evicts=False
).TestCase
TestTieredOverRoomyL2.settings = MODEL_SETTINGS

TestTieredBothEvicting = make_cache_state_machine(
    lambda: TieredCache(MemoryCache(1024), MemoryCache(SMALL)),
    evicts=True,
    max_bytes=1024 + SMALL,
    max_numel=700,
).TestCase
TestTieredBothEvicting.settings = MODEL_SETTINGS

TestTieredNested = make_cache_state_machine(
    lambda: TieredCache(MemoryCache(1024), TieredCache(MemoryCache(SMALL), MemoryCache(1 << 22))),
    evicts=False,
).TestCase
TestTieredNested.settings = MODEL_SETTINGS

_RING_A = EntryKeyring.from_secrets(hashlib.sha256(b"model test secret A").digest())
_RING_B = EntryKeyring.from_secrets(hashlib.sha256(b"model test secret B").digest())

TestTieredSignedEvicting = make_cache_state_machine(
    lambda: TieredCache(MemoryCache(1024, keyring=_RING_A), MemoryCache(SMALL, keyring=_RING_B)),
    evicts=True,
    max_bytes=1024 + SMALL,
    max_numel=700,
).TestCase
TestTieredSignedEvicting.settings = MODEL_SETTINGS
