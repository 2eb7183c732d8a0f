"""SGLang integration: `MMKeyEmbeddingStore`, a verified embedding store for SGLang's global
multimodal cache (``--enable-mm-global-cache``), and the plugin that lets SGLang load it.

SGLang builds its store with no arguments, so this one configures itself from the
environment: ``MMKEY_NAMESPACE`` (required: the model, revision and preprocessing whose
embeddings it holds), Mooncake's ``MOONCAKE_*`` variables (`MooncakeConfig.from_env`) and
``MMKEY_DEADLINE`` (seconds one store call may block SGLang's I/O thread, default 2).

Every SGLang hash text becomes an `EmbeddingKey` (see `sglang_digest`); every entry is a
self-describing mmkey entry (dtype, shape, key echo, checksum) verified on read against
the pool it lands in. Anything that does not verify, any store fault and any bad input is
``False`` (a miss for SGLang), logged at a limited rate and counted in `stats`; no call
raises into SGLang.

Data path: the pools SGLang registers are registered with Mooncake, and a put sends each
new entry straight from its pool pages (`MooncakeCache.insert_from`: a header sealed over
the pages, then header and pages in one multi-buffer put). A get lands entries in the
cache's own staging buffers and copies each into its pages only after it verified
(`MooncakeCache.read_into`): Mooncake cannot cancel a transfer, so a read given up at the
deadline may still land later, and SGLang hands the pages of a missed read to other
entries at once.

The plugin (`register_plugin`, entry point ``mmkey`` in group ``sglang.srt.plugins``) does
nothing unless ``MMKEY_SGLANG_BACKEND=1``: then the backend name ``mooncake`` (the only one
``--mm-global-cache-backend`` accepts) creates this store, and so does ``mmkey``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
from sglang.srt.mem_cache.embedding_store import EmbeddingStore

from mmkey.cache.mooncake import MooncakeCache
from mmkey.cache.mooncake_config import MooncakeConfig
from mmkey.cache.protocol import CacheStats
from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.errors import InvalidKey
from mmkey.integrations._common import Counters, RateLimitedLog
from mmkey.integrations._sglang_keys import sglang_digest, sglang_key
from mmkey.integrations._sglang_pools import REGISTRATION_ORDER, PoolTable, UnknownBuffer
from mmkey.integrations._sglang_ranks import cover_spawned_encoders
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    import torch

__all__ = [
    "BACKEND_ENV",
    "BACKEND_NAME",
    "DEADLINE_ENV",
    "DEFAULT_DEADLINE",
    "NAMESPACE_ENV",
    "REGISTRATION_ORDER",
    "MMKeyEmbeddingStore",
    "config_from_env",
    "namespace_from_env",
    "register_plugin",
    "sglang_digest",
    "sglang_key",
]

NAMESPACE_ENV = "MMKEY_NAMESPACE"
"""Names what produced the embeddings (model, revision, preprocessing); required."""
BACKEND_ENV = "MMKEY_SGLANG_BACKEND"
"""``1`` makes the plugin replace SGLang's ``mooncake`` embedding store backend."""
DEADLINE_ENV = "MMKEY_DEADLINE"
"""Seconds one store call may block SGLang's I/O thread (default `DEFAULT_DEADLINE`)."""
DEFAULT_DEADLINE = 2.0
BACKEND_NAME = "mmkey"
"""The backend name this store is registered under besides ``mooncake``."""

_MODULE = __name__
_CLASS = "MMKeyEmbeddingStore"
_LOG_EVERY = 10.0

logger: logging.Logger = logging.getLogger(__name__)


def namespace_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``MMKEY_NAMESPACE``, checked; `ValueError` naming the variable when it is missing."""
    env = os.environ if environ is None else environ
    namespace = env.get(NAMESPACE_ENV, "")
    if not namespace:
        raise ValueError(
            f"{NAMESPACE_ENV} is not set: name the model, revision and preprocessing whose "
            f"embeddings this SGLang server stores, e.g. {NAMESPACE_ENV}=qwen2.5-vl-7b@main"
        )
    EmbeddingKey(namespace, Modality.IMAGE, HashScheme.SGLANG, MMHash(0))  # InvalidKey if bad
    return namespace


def config_from_env(environ: Mapping[str, str] | None = None) -> MooncakeConfig:
    """`MooncakeConfig.from_env` with the deadline from ``MMKEY_DEADLINE``."""
    env = os.environ if environ is None else environ
    text = env.get(DEADLINE_ENV, "")
    try:
        deadline = float(text) if text else DEFAULT_DEADLINE
    except ValueError:
        raise ValueError(f"{DEADLINE_ENV}={text!r} is not a number of seconds, e.g. 2.0") from None
    if not (math.isfinite(deadline) and deadline > 0):
        raise ValueError(f"{DEADLINE_ENV}={text!r} must be a positive number of seconds")
    return MooncakeConfig.from_env(env, deadline=deadline)


@attrs.define(slots=True)
class _Transfer:
    """One embedding of a batch: where it is in the batch, its key, and its pool rows."""

    index: int
    key: EmbeddingKey
    rows: list[torch.Tensor]


class MMKeyEmbeddingStore(EmbeddingStore):
    """SGLang's `EmbeddingStore` over `MooncakeCache`: typed keys, verified entries, deadlines.

    Built with no arguments as SGLang builds backends (the environment configures it);
    `namespace` and `config` override the environment, e.g. in tests. Raises `ValueError`
    naming ``MMKEY_NAMESPACE`` or ``MOONCAKE_MASTER`` when one is missing.
    """

    def __init__(self, *, namespace: str | None = None, config: MooncakeConfig | None = None) -> None:
        self._namespace = namespace_from_env() if namespace is None else namespace
        EmbeddingKey(self._namespace, Modality.IMAGE, HashScheme.SGLANG, MMHash(0))
        value: object = config
        if value is not None and not isinstance(value, MooncakeConfig):
            raise TypeError(f"config must be a MooncakeConfig, got {type(value).__name__}")
        self._cache = MooncakeCache(config_from_env() if config is None else config)
        self._pools = PoolTable()
        self._counts = Counters()
        self._log = RateLimitedLog(logger, logging.ERROR, "mmkey embedding store: %s%s", period=_LOG_EVERY)

    @property
    def namespace(self) -> str:
        """The namespace of every key this store reads and writes."""
        return self._namespace

    @property
    def cache(self) -> MooncakeCache:
        """The Mooncake cache behind this store."""
        return self._cache

    # -- SGLang's EmbeddingStore -----------------------------------------------------------

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Record an embedding pool (its modality follows `REGISTRATION_ORDER`) and register
        its memory with the store, so puts send entries straight from its pages."""
        self._pools.register(tensor)
        self._cache.register_memory(tensor)

    def register_pool(self, tensor: torch.Tensor, modality: Modality) -> None:
        """Record an embedding pool of a known modality, registered as `register_buffer` does."""
        value: object = modality
        if not isinstance(value, Modality):
            raise TypeError(f"modality must be a Modality member, got {value!r}")
        self._pools.register(tensor, modality)
        self._cache.register_memory(tensor)

    def get_key(self, mm_hash: str) -> str:
        """The store key of `mm_hash` in the vision pool; `InvalidKey` for bad hash text."""
        return sglang_key(self._namespace, REGISTRATION_ORDER[0], mm_hash).to_key()

    def key_for(self, mm_hash: str, modality: Modality) -> EmbeddingKey:
        """The `EmbeddingKey` of `mm_hash` for a pool of `modality`."""
        return sglang_key(self._namespace, modality, mm_hash)

    def batch_is_exist(self, hashes: list[str]) -> list[bool]:
        """Whether an entry exists for each hash, in any pool's modality."""
        return self._guard("batch_is_exist", hashes, lambda: self._exist(hashes))

    def batch_get_into_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        """Read each entry, verify it, and copy it into its pool pages; whether each landed."""
        return self._guard("get", hashes, lambda: self._get(hashes, ptrs, sizes))

    def batch_put_from_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        """Store the embedding in each entry's pool pages; whether each is stored."""
        return self._guard("put", hashes, lambda: self._put(hashes, ptrs, sizes))

    def batch_get(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """`batch_get_into_multi_buffers` with one contiguous buffer per entry."""
        return self._guard(
            "get", hashes, lambda: self._get(hashes, [[p] for p in ptrs], [[s] for s in sizes])
        )

    def batch_put(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """`batch_put_from_multi_buffers` with one contiguous buffer per entry."""
        return self._guard(
            "put", hashes, lambda: self._put(hashes, [[p] for p in ptrs], [[s] for s in sizes])
        )

    # -- the rest of the store -------------------------------------------------------------

    def stats(self) -> CacheStats:
        """Counters since creation. `hits` and `misses` count entries SGLang asked for;
        `corrupt` includes entries whose dtype or shape did not fit the pool pages; `skipped`
        counts hashes and buffers refused without asking the store (bad text, unknown memory)."""
        inner = self._cache.stats()
        c = self._counts.totals()
        return CacheStats(
            hits=c.get("hits", 0),
            misses=c.get("misses", 0),
            inserts=inner.inserts,
            corrupt=inner.corrupt,
            errors=inner.errors + c.get("failed", 0),
            forged=inner.forged,
            skipped=inner.skipped + c.get("rejected", 0),
        )

    def close(self) -> None:
        """Close the Mooncake cache; later calls answer ``False``."""
        self._cache.close()

    def __repr__(self) -> str:
        return f"MMKeyEmbeddingStore(namespace={self._namespace!r}, {self._cache!r})"

    # -- internals -------------------------------------------------------------------------

    def _guard(self, what: str, hashes: Sequence[str], call: Callable[[], list[bool]]) -> list[bool]:
        """`call()`, or all ``False`` (logged, counted) if it raises: nothing reaches SGLang."""
        try:
            return call()
        except Exception as exc:
            self._counts.add(failed=1)
            self._log(f"{what}-failed", f"{what} failed ({type(exc).__name__}: {exc})", exc_info=True)
            try:
                return [False] * len(hashes)
            except TypeError:
                return []

    def _parse(self, index: int, text: str, modality: Modality) -> EmbeddingKey | None:
        try:
            return sglang_key(self._namespace, modality, text)
        except (InvalidKey, TypeError) as exc:
            self._counts.add(rejected=1)
            self._log("bad-hash", f"hash #{index} refused: {exc}")
            return None

    def _exist(self, hashes: list[str]) -> list[bool]:
        keys: list[EmbeddingKey] = []
        owners: list[int] = []
        modalities = self._pools.modalities()
        for i, text in enumerate(hashes):
            for modality in modalities:
                key = self._parse(i, text, modality)
                if key is None:
                    break
                keys.append(key)
                owners.append(i)
        result = [False] * len(hashes)
        for owner, found in zip(owners, self._cache.batch_is_exist(keys) if keys else []):
            result[owner] = result[owner] or found
        return result

    def _plan(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[_Transfer]:
        if not len(hashes) == len(ptrs) == len(sizes):
            raise ValueError(
                f"{len(hashes)} hashes, {len(ptrs)} pointer lists and {len(sizes)} size lists"
            )
        plans: list[_Transfer] = []
        for i, (text, run_ptrs, run_sizes) in enumerate(zip(hashes, ptrs, sizes)):
            try:
                pool, rows = self._pools.locate(run_ptrs, run_sizes)
            except UnknownBuffer as exc:
                self._counts.add(rejected=1)
                self._log("bad-buffer", f"hash #{i} refused: {exc}")
                continue
            key = self._parse(i, text, pool.modality)
            if key is None:
                continue
            plans.append(_Transfer(i, key, rows))
        return plans

    def _get(self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[bool]:
        result = [False] * len(hashes)
        plans = self._plan(hashes, ptrs, sizes)
        if plans:  # entries that do not verify are counted and logged by the cache
            landed = self._cache.read_into([p.key for p in plans], [p.rows for p in plans])
            for plan, ok in zip(plans, landed):
                result[plan.index] = ok
        hits = sum(result)
        self._counts.add(hits=hits, misses=len(result) - hits)
        return result

    def _put(self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[bool]:
        result = [False] * len(hashes)
        plans = self._plan(hashes, ptrs, sizes)
        if plans:
            stored = self._cache.insert_from([p.key for p in plans], [p.rows for p in plans])
            for plan, ok in zip(plans, stored):
                result[plan.index] = ok
        return result


def register_plugin() -> None:
    """SGLang general plugin: with ``MMKEY_SGLANG_BACKEND=1``, register `MMKeyEmbeddingStore`
    as the ``mooncake`` and ``mmkey`` embedding store backends, and make the encoder
    processes SGLang spawns (TP ranks above 0, DP workers) do the same before they start
    (`cover_spawned_encoders`); otherwise do nothing.

    Raises `ValueError` (SGLang logs it and keeps its own backend) for any other value of
    the switch, and when ``MMKEY_NAMESPACE`` is missing with the switch on.
    """
    switch = os.environ.get(BACKEND_ENV, "")
    if switch in ("", "0"):
        return
    if switch != "1":
        raise ValueError(f"{BACKEND_ENV}={switch!r}: set 1 to use mmkey's store, 0 or unset not to")
    namespace_from_env()
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

    for name in ("mooncake", BACKEND_NAME):
        EmbeddingStoreFactory.register_backend(name, _MODULE, _CLASS)
    cover_spawned_encoders()
    logger.info(
        "mmkey: --mm-global-cache-backend mooncake now creates %s.%s (%s=1)", _MODULE, _CLASS, BACKEND_ENV
    )
