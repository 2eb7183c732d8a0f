"""`MMKeyEmbeddingStore`: SGLang's `EmbeddingStore` over `MooncakeCache` (typed keys,
verified entries, bounded calls); see the package's docstring for the data path."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

import attrs
from sglang.srt.mem_cache.embedding_store import EmbeddingStore

from mmkey._log import Counters, RateLimitedLog
from mmkey.cache.mooncake import Added, MooncakeCache
from mmkey.cache.mooncake.config import MooncakeConfig
from mmkey.cache.protocol import CacheStats, Claim
from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.errors import InvalidKey
from mmkey.integrations.sglang._claimed import WonClaims
from mmkey.integrations.sglang._keys import sglang_key
from mmkey.integrations.sglang._plugin import refuse_on_plugin_errors
from mmkey.integrations.sglang._pools import REGISTRATION_ORDER, PoolTable, UnknownBuffer
from mmkey.integrations.sglang._recent import RecentlyPresent
from mmkey.integrations.sglang._store_settings import (
    BACKEND_ENV,
    HASH_ENV,
    SGLangConfigError,
    hash_mode,
    namespace_from_env,
    settings_from_env,
)
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    import torch

__all__ = ["MMKeyEmbeddingStore"]

_LOG_EVERY = 10.0

logger: logging.Logger = logging.getLogger(__name__)


@attrs.define(slots=True)
class _Transfer:
    """One embedding of a batch: where it is in the batch, its key, and its pool rows."""

    index: int
    key: EmbeddingKey
    rows: list[torch.Tensor]


class MMKeyEmbeddingStore(EmbeddingStore):
    """SGLang's `EmbeddingStore` over `MooncakeCache`: typed keys, verified entries, timeouts.

    Built with no arguments as SGLang builds backends (the environment configures it, and
    the plugin's configuration errors make it raise `SGLangConfigError`); `namespace`,
    `config`, `hashes` and ``tp_rank`` override the environment, e.g. in tests. `hashes` is the
    scheme of SGLang's feature hashes (`HashScheme.SGLANG`, or `HashScheme.BLAKE3` under
    ``MMKEY_SGLANG_HASH=blake3``). Only the process that does SGLang's store I/O (TP rank 0:
    SGLang gates every store call on it) connects to Mooncake and registers memory; the
    others only record their pools, and answer any call ``False``.
    """

    def __init__(
        self,
        *,
        namespace: str | None = None,
        config: MooncakeConfig | None = None,
        hashes: HashScheme | None = None,
        tp_rank: int | None = None,
    ) -> None:
        if namespace is None or config is None:  # built by SGLang: refuse what the plugin refused
            refuse_on_plugin_errors()
        self._namespace = namespace_from_env() if namespace is None else namespace
        EmbeddingKey(self._namespace, Modality.IMAGE, HashScheme.SGLANG, MMHash(0))
        value: object = config
        if value is not None and not isinstance(value, MooncakeConfig):
            raise TypeError(f"config must be a MooncakeConfig, got {type(value).__name__}")
        scheme = hash_mode() if hashes is None else hashes
        if scheme not in (HashScheme.SGLANG, HashScheme.BLAKE3):
            raise TypeError(f"hashes must be HashScheme.SGLANG or HashScheme.BLAKE3, got {scheme!r}")
        if hashes is None and scheme is HashScheme.BLAKE3 and not _hash_hooks_installed():
            raise SGLangConfigError(
                f"{HASH_ENV}=blake3 but SGLang still hashes with its own 64-bit hash in this process: "
                f"the plugin installs the BLAKE3 hash; set {BACKEND_ENV}=1 instead of registering "
                "the backend by hand"
            )
        self._hashes = scheme
        if config is None:
            settings = settings_from_env()
            config = settings.config
            _log_start(f"namespace={self._namespace} hashes={self._hashes.value} {settings.describe()}")
        self._io = _does_io(tp_rank)
        self._cache: MooncakeCache | None = MooncakeCache(config) if self._io else None
        self._pools = PoolTable()
        self._known: dict[str, Modality] = {}  # hash text -> modality of its pool, last few
        # hash text -> the key text a lookup asks (a tuple where it asks one key per pool)
        self._lookups: dict[str, str | tuple[str, ...]] = {}
        self._memo_lock = threading.Lock()
        self._recent = RecentlyPresent(_REMEMBER_YES_S, _KNOWN_HASHES)
        self._counts = Counters()
        self._won = WonClaims(self._give_back, config.claim_wait, _KNOWN_HASHES)
        self._wait_slots = threading.BoundedSemaphore(_WAITERS)
        self._log = RateLimitedLog(logger, logging.ERROR, "mmkey embedding store: %s%s", period=_LOG_EVERY)

    @property
    def namespace(self) -> str:
        """The namespace of every key this store reads and writes."""
        return self._namespace

    @property
    def hashes(self) -> HashScheme:
        """The scheme SGLang's feature hashes are read as (`HashScheme.SGLANG` or ``BLAKE3``)."""
        return self._hashes

    @property
    def does_io(self) -> bool:
        """Whether this process does SGLang's store I/O (TP rank 0) and so holds a cache."""
        return self._io

    @property
    def cache(self) -> MooncakeCache:
        """The Mooncake cache behind this store; `RuntimeError` in a process that does no I/O."""
        if self._cache is None:
            raise RuntimeError("this SGLang process does no store I/O (TP rank above 0): no cache")
        return self._cache

    # -- SGLang's EmbeddingStore -----------------------------------------------------------

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Record an embedding pool (its modality follows ``REGISTRATION_ORDER``); in
        trusted-network mode also register its memory with the store, so puts send entries
        straight from its pages (otherwise they go through staging)."""
        self._pools.register(tensor)
        with self._memo_lock:  # a new pool: lookups of unknown hashes ask its key too
            self._lookups.clear()
        if self._cache is not None:
            self._cache.register_memory(tensor)

    def register_pool(self, tensor: torch.Tensor, modality: Modality) -> None:
        """Record an embedding pool of a known modality, registered as `register_buffer` does."""
        value: object = modality
        if not isinstance(value, Modality):
            raise TypeError(f"modality must be a Modality member, got {value!r}")
        self._pools.register(tensor, modality)
        with self._memo_lock:
            self._lookups.clear()
        if self._cache is not None:
            self._cache.register_memory(tensor)

    def get_key(self, mm_hash: str) -> str:
        """The store key of `mm_hash` in the vision pool; `InvalidKey` for bad hash text."""
        return sglang_key(self._namespace, REGISTRATION_ORDER[0], mm_hash, self._hashes).to_key()

    def key_for(self, mm_hash: str, modality: Modality) -> EmbeddingKey:
        """The `EmbeddingKey` of `mm_hash` for a pool of ``modality``."""
        return sglang_key(self._namespace, modality, mm_hash, self._hashes)

    def batch_is_exist(self, hashes: list[str]) -> list[bool]:
        """Whether an entry exists for each hash, in any pool's modality. Hashes answered yes
        (found, stored, or read and verified) within the last second are answered from
        memory when all of them are: a stale yes costs SGLang a failed read, then it encodes.

        Single-flight (the cache's ``claim_wait`` > 0): each missing hash is claimed. One this
        store won is answered no (SGLang encodes it; its put ends the claim). When every
        missing hash this call claimed is held by another encoder (another server, or another
        request of this one), the call waits for their entries, at most ``claim_wait``, and
        answers yes for each that landed and verified: SGLang then reads it as a global hit.
        A call that won any hash waits for none (SGLang runs the vision tower for it anyway)."""
        if self._recent.all_present(hashes):
            return [True] * len(hashes)
        return self._guard("batch_is_exist", hashes, lambda: self._look(hashes))

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
        """Counters since creation. ``hits`` and `misses` count entries SGLang asked for;
        `corrupt` includes entries whose dtype or shape did not fit the pool pages; `skipped`
        counts hashes and buffers refused without asking the store (bad text, unknown memory)
        and puts skipped because the store already held a verified entry for the hash, or
        because another encoder stored it, or was storing it, first (a racing put).
        ``claims_won``, ``waits_served``, ``waits_timed_out`` and ``coalesced`` are the cache's
        single-flight counters of this store's lookups (``coalesced``: entries read and
        verified after a wait, each an encode saved)."""
        inner = CacheStats() if self._cache is None else self._cache.stats()
        c = self._counts.totals()
        return CacheStats(
            hits=c.get("hits", 0),
            misses=c.get("misses", 0),
            inserts=inner.inserts,
            corrupt=inner.corrupt,
            errors=inner.errors + c.get("failed", 0),
            forged=inner.forged,
            skipped=inner.skipped + c.get("rejected", 0) + c.get("kept", 0),
            squatted=inner.squatted,
            unsigned=inner.unsigned,
            unknown_key=inner.unknown_key,
            expired=inner.expired,
            bad_mac=inner.bad_mac,
            unsigned_served=inner.unsigned_served,
            oversized=inner.oversized,
            claims_won=inner.claims_won,
            waits_served=inner.waits_served,
            waits_timed_out=inner.waits_timed_out,
            coalesced=inner.coalesced,
        )

    def close(self) -> None:
        """Give back the claims this store holds and close the Mooncake cache; later calls
        answer ``False``."""
        self._recent.close()
        self._won.close()
        if self._cache is not None:
            self._cache.close()

    def __repr__(self) -> str:
        inner = repr(self._cache) if self._cache is not None else "no store I/O in this process"
        return f"MMKeyEmbeddingStore(namespace={self._namespace!r}, {inner})"

    # -- internals -------------------------------------------------------------------------

    def _guard(self, what: str, hashes: Sequence[str], call: Callable[[], list[bool]]) -> list[bool]:
        """`call()`, or all ``False`` (logged, counted) if it raises: nothing reaches SGLang."""
        try:
            if self._cache is None:
                raise RuntimeError("called in a process that does no store I/O (TP rank above 0)")
            return call()
        except Exception as exc:
            self._recent.clear()
            self._counts.add(failed=1)
            self._log(f"{what}-failed", f"{what} failed ({type(exc).__name__}: {exc})", exc_info=True)
            try:
                return [False] * len(hashes)
            except TypeError:
                return []

    def _parse(self, index: int, text: str, modality: Modality) -> EmbeddingKey | None:
        try:
            return sglang_key(self._namespace, modality, text, self._hashes)
        except (InvalidKey, TypeError) as exc:
            self._counts.add(rejected=1)
            self._log("bad-hash", f"hash #{index} refused: {exc}")
            return None

    def _remember(self, text: str, modality: Modality) -> None:
        """Note the pool modality of a hash this store moved, so lookups ask one key for it."""
        with self._memo_lock:
            if self._known.get(text) is not modality:
                _bounded_set(self._known, text, modality)
                self._lookups.pop(text, None)

    def _lookup_texts(self, index: int, text: str) -> tuple[str, ...]:
        """The key texts a lookup of `text` asks (its pool's, or every pool's); remembered."""
        value: object = text
        if not isinstance(value, str):
            self._parse(index, text, REGISTRATION_ORDER[0])  # refused: counted and logged
            return ()
        found = self._lookups.get(text)
        if found is not None:
            return (found,) if isinstance(found, str) else found
        known = self._known.get(text)
        texts: list[str] = []
        for modality in self._pools.modalities() if known is None else (known,):
            key = self._parse(index, text, modality)
            if key is None:
                return ()
            texts.append(key.to_key())
        _bounded_set(self._lookups, text, texts[0] if len(texts) == 1 else tuple(texts))
        return tuple(texts)

    def _exist(self, hashes: list[str]) -> list[bool]:
        assert self._cache is not None
        with self._memo_lock:
            single = _one_text_each(self._lookups, hashes)
        if single is not None:  # every hash remembered with one key: no per-hash step
            answers = self._cache._exist_texts(single) if single else []
            if len(answers) != len(single):  # whose answer is whose is unknown: trust none
                raise ValueError(f"the cache answered {len(answers)} of {len(single)} lookups")
            self._recent.note(hashes, answers)
            return answers
        texts: list[str] = []
        owners: list[int] = []
        with self._memo_lock:
            for i, text in enumerate(hashes):
                group = self._lookup_texts(i, text)
                texts.extend(group)
                owners.extend([i] * len(group))
        result = [False] * len(hashes)
        answers = self._cache._exist_texts(texts) if texts else []
        for owner, found in zip(owners, answers, strict=True):
            result[owner] = result[owner] or found
        self._recent.note(hashes, result)
        return result

    def _look(self, hashes: list[str]) -> list[bool]:
        """`_exist`, then single-flight for the hashes it missed (see `batch_is_exist`)."""
        answers = self._exist(hashes)
        cache = self._cache
        if cache is None or all(answers) or cache.claim_wait <= 0:
            return answers
        items: list[object] = list(hashes)  # SGLang's list: an item may not be text
        missing: dict[str, EmbeddingKey] = {}
        for item, found in zip(items, answers, strict=True):
            if not found and isinstance(item, str) and item not in missing:
                key = self._claim_key(item)
                if key is not None:
                    missing[item] = key
        if not missing:
            return answers
        claims = cache.claim(list(missing.values()))
        won = {t: k for (t, k), c in zip(missing.items(), claims, strict=True) if c is Claim.WON}
        held = {t: k for (t, k), c in zip(missing.items(), claims, strict=True) if c is Claim.HELD}
        self._won.add(won)
        if won or not held or not self._wait_slots.acquire(blocking=False):
            return answers  # encoded here: this call runs the tower anyway, or waits are full
        try:
            start = time.monotonic()
            entries = cache.wait_for_embeddings(list(held.values()))
        finally:
            self._wait_slots.release()
        landed = {text for text, entry in zip(held, entries, strict=True) if entry is not None}
        logger.info(
            "mmkey SGLang store: waited %.3f s for %d item(s) another encoder claimed: "
            "%d served, %d encoded here",
            time.monotonic() - start,
            len(held),
            len(landed),
            len(held) - len(landed),
        )
        result = [
            found or (isinstance(item, str) and item in landed)
            for item, found in zip(items, answers, strict=True)
        ]
        self._recent.note(hashes, result)
        return result

    def _claim_key(self, text: str) -> EmbeddingKey | None:
        """The key a lookup claims for `text`: its pool's, or the first pool's (the vision
        pool: images and videos) for a hash this store never moved; None for bad text
        (refused by the lookup already)."""
        with self._memo_lock:
            modality = self._known.get(text)
        if modality is None:
            modality = self._pools.modalities()[0]
        try:
            return sglang_key(self._namespace, modality, text, self._hashes)
        except (InvalidKey, TypeError):
            return None

    def _give_back(self, keys: list[EmbeddingKey]) -> None:
        """Release claims this store won (their put is done, or they lapsed)."""
        if self._cache is not None:
            self._cache.release(keys)

    def _plan(self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[_Transfer]:
        if not len(hashes) == len(ptrs) == len(sizes):
            raise ValueError(f"{len(hashes)} hashes, {len(ptrs)} pointer lists and {len(sizes)} size lists")
        plans: list[_Transfer] = []
        for i, (text, run_ptrs, run_sizes) in enumerate(zip(hashes, ptrs, sizes, strict=True)):
            try:
                pool, rows = self._pools.locate(run_ptrs, run_sizes)
            except UnknownBuffer as exc:
                self._counts.add(rejected=1)
                self._log("bad-buffer", f"hash #{i} refused: {exc}")
                continue
            key = self._parse(i, text, pool.modality)
            if key is None:
                continue
            self._remember(text, pool.modality)
            plans.append(_Transfer(i, key, rows))
        return plans

    def _get(self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[bool]:
        assert self._cache is not None
        result = [False] * len(hashes)
        plans = self._plan(hashes, ptrs, sizes)
        if plans:  # entries that do not verify are counted and logged by the cache
            landed = self._cache.read_into([p.key for p in plans], [p.rows for p in plans])
            for plan, ok in zip(plans, landed, strict=True):
                result[plan.index] = ok
        hits = sum(result)
        self._counts.add(hits=hits, misses=len(result) - hits)
        self._recent.note(hashes, result)
        return result

    def _put(self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[bool]:
        """Store each new entry; an entry the store holds already and that verifies (another
        encoder of the fleet stored the same image first) is kept, not rewritten, and one
        that does not verify, does not fit or cannot be read back is replaced. A new entry
        is added only if no encoder holds or is writing it: of encoders racing to put one
        image, one writes; the others keep its entry (``True``, counted as skipped). The
        claims this store won for these hashes end here, once the entries are written (or
        failed to be)."""
        try:
            return self._put_entries(hashes, ptrs, sizes)
        finally:
            self._won.end(hashes)

    def _put_entries(self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[bool]:
        cache = self._cache
        assert cache is not None
        result = [False] * len(hashes)
        plans = self._plan(hashes, ptrs, sizes)
        if not plans:
            return result
        held = cache.batch_is_exist([p.key for p in plans])
        present = [p for p, found in zip(plans, held, strict=True) if found]
        kept = self._verified(present)
        for index in kept:
            result[index] = True
        absent = [p for p, found in zip(plans, held, strict=True) if not found]
        stale = [p for p in present if p.index not in kept]  # held, but it does not verify
        for plans_of, outcome in ((absent, self._add), (stale, self._replace)):
            if plans_of:
                for plan, ok in zip(plans_of, outcome(plans_of), strict=True):
                    result[plan.index] = ok
        self._recent.note(hashes, result)
        return result

    def _add(self, plans: list[_Transfer]) -> list[bool]:
        """Write entries the store does not hold, unless another encoder writes one first
        (kept: ``True``, counted); whether each is stored or kept. A key another client's
        put session reserves but the store does not hold is ``False`` until the cache
        writes over the reservation (`Added.RESERVED`: a squat, or a write in progress)."""
        cache = self._cache
        assert cache is not None
        added = cache.add_from([p.key for p in plans], [p.rows for p in plans])
        self._counts.add(kept=sum(outcome is Added.HELD for outcome in added))
        return [outcome is Added.STORED or outcome is Added.HELD for outcome in added]

    def _replace(self, plans: list[_Transfer]) -> list[bool]:
        """Overwrite held entries that do not verify or fit; whether each is stored."""
        cache = self._cache
        assert cache is not None
        return cache.insert_from([p.key for p in plans], [p.rows for p in plans])

    def _verified(self, present: list[_Transfer]) -> set[int]:
        """The batch indices of held entries that verify and fit their pool rows (counted kept)."""
        cache = self._cache
        assert cache is not None
        if not present:
            return set()
        entries = cache.get_embeddings([p.key for p in present])
        kept = {
            plan.index
            for plan, entry in zip(present, entries, strict=True)
            if entry is not None and _fits(entry, plan.rows)
        }
        self._counts.add(kept=len(kept))
        return kept


def _hash_hooks_installed() -> bool:
    from mmkey.integrations.sglang._hash import installed

    return installed()


_V = TypeVar("_V")
_KNOWN_HASHES = 8192
"""How many hashes' pool modalities (and lookup keys, and recent yes answers) a store remembers."""
_REMEMBER_YES_S = 1.0
"""How long `batch_is_exist` answers a hash yes from memory after the store last did."""
_WAITERS = max(1, min(32, (os.cpu_count() or 1) + 4) // 2)
"""How many lookups of one store wait for claimed items at once: half the threads of asyncio's
default executor, whose threads SGLang's lookups (and the claimant's own insert) run on, so
waiters never take the thread a claimant needs to put what they wait for."""


def _one_text_each(lookups: dict[str, str | tuple[str, ...]], hashes: list[str]) -> list[str] | None:
    """The one remembered lookup key text of each hash, in order, when every hash has one
    (C-level loops only); ``None`` otherwise (the caller goes hash by hash)."""
    try:
        found = list(map(lookups.get, hashes))
    except TypeError:  # an unhashable item: the per-hash path refuses it
        return None
    return cast("list[str]", found) if set(map(type, found)) <= {str} else None


def _bounded_set(memo: dict[str, _V], text: str, value: _V) -> None:
    """`memo[text] = value`, dropping the oldest entry beyond `_KNOWN_HASHES`."""
    if text not in memo and len(memo) >= _KNOWN_HASHES:
        del memo[next(iter(memo))]
    memo[text] = value


def _fits(entry: torch.Tensor, rows: list[torch.Tensor]) -> bool:
    """Whether a stored embedding has exactly the dtype and shape of the pool rows."""
    first = rows[0]
    return (
        entry.dtype == first.dtype
        and entry.dim() == 2
        and entry.shape[1] == first.shape[1]
        and entry.shape[0] == sum(r.shape[0] for r in rows)
    )


def _does_io(tp_rank: int | None) -> bool:
    """Whether this process does the store I/O: TP rank 0, as SGLang's encoder gates it
    (SGLang's runtime context when ``tp_rank`` is None; a process outside one does I/O)."""
    if tp_rank is None:
        try:
            from sglang.srt.runtime_context import get_parallel

            rank: object = get_parallel().tp_rank
        except Exception:
            return True
        tp_rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
    return tp_rank == 0


_started = False


def _log_start(text: str) -> None:
    """Log the effective configuration, once per process."""
    global _started
    if not _started:
        _started = True
        logger.info("mmkey SGLang store: %s", text)
