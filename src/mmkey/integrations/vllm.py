"""vLLM encoder-cache connector on mmkey caches: `MMKeyECConnector`.

Load it by module path (vLLM >= 0.33)::

    --ec-transfer-config '{"ec_connector": "MMKeyECConnector",
                           "ec_connector_module_path": "mmkey.integrations.vllm",
                           "ec_role": "ec_both"}'

Each vLLM identifier (an ``mm_hash`` or a caller's uuid, opaque text) is stored under
``EmbeddingKey(namespace, modality, HashScheme.ID, identifier_digest(identifier))``: the
namespace names the model setup (from `VllmConfig`, or ``"namespace"`` in
``ec_connector_extra_config``), the modality comes from the request's features. Entries are
mmkey's self-verifying entries in a `MooncakeCache` (``MOONCAKE_*`` variables or
``"mooncake"`` in the extra config) or a `MemoryCache` (``"store": "memory"``).

The scheduler side asks the store what exists (one batched call per request, bounded by the
cache's deadline); the worker side loads the hits onto its device before the encoder runs,
and saves new encoder outputs on a background thread within a byte budget. Store faults are
misses: counted, logged at most once a minute per kind, and the cache re-joins the store by
itself.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import attrs
import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

from mmkey.cache.memory import MemoryCache
from mmkey.cache.mooncake import MooncakeCache
from mmkey.cache.protocol import EmbeddingCache
from mmkey.digest import Modality
from mmkey.integrations._background_saver import BackgroundSaver
from mmkey.integrations._common import Counters, RateLimitedLog
from mmkey.integrations._vllm_settings import (
    ConnectorSettings,
    StoreKind,
    identifier_keys,
    modality_of,
    vllm_namespace,
)
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "LoadItem",
    "MMKeyECConnector",
    "MMKeyECMetadata",
    "MMKeyECStats",
    "MMKeyECWorkerMetadata",
    "namespace_from_vllm_config",
]

logger: logging.Logger = logging.getLogger(__name__)

_ALL_MODALITIES = tuple(Modality)
_UNAVAILABLE_FOR_S = 30.0
"""How long the scheduler side stops claiming an identifier whose load failed on a worker."""
_WARN_EVERY_S = 60.0
_SHUTDOWN_WAIT_S = 5.0
_MAX_TRACKED = 4096
_LOAD_CHUNK_BYTES = 64 << 20


def namespace_from_vllm_config(vllm_config: VllmConfig) -> str:
    """The namespace of a vLLM setup: model, revision, multimodal config and dtype.

    The multimodal part is vLLM's own hash of the encoder configuration plus the processor
    kwargs.

    Raises `ValueError` when the config has no model (a model-less test): pass
    ``"namespace"`` in ``ec_connector_extra_config`` then.
    """
    model_config = vllm_config.model_config
    if model_config is None:
        raise ValueError(
            "MMKeyECConnector: this VllmConfig has no model config to derive the cache "
            "namespace from; set ec_connector_extra_config={'namespace': '<model@revision>'}"
        )
    mm_config = model_config.multimodal_config
    encoder = "no-multimodal-config"
    if mm_config is not None:
        # vLLM's hash covers the encoder's computation; the processor kwargs (resizing and
        # the like) change the embedding of a caller's uuid too, which vLLM's hash does not
        kwargs = json.dumps(mm_config.mm_processor_kwargs or {}, sort_keys=True, default=repr)
        encoder = f"{mm_config.compute_hash()}|{kwargs}"
    return vllm_namespace(
        str(model_config.model), model_config.revision, encoder, str(model_config.dtype)
    )


# -- what travels between the scheduler side and the workers ---------------------------------


@attrs.frozen(slots=True)
class LoadItem:
    """One encoder output a worker loads this step."""

    identifier: str
    modality: Modality
    num_embeds: int
    """Rows the scheduler expects (vLLM's ``get_num_encoder_embeds``); others are not served."""


@attrs.frozen(slots=True)
class MMKeyECMetadata(ECConnectorMetadata):
    """The scheduler's plan for one step: what to load, and the modality of what to save."""

    loads: tuple[LoadItem, ...] = ()
    saves: dict[str, Modality] = attrs.field(factory=dict)


@attrs.frozen(slots=True)
class MMKeyECWorkerMetadata(ECConnectorWorkerMetadata):
    """Identifiers a worker could not load this step (missing, corrupt, or a store fault)."""

    failed: frozenset[str] = frozenset()

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        """Union of the failures of both workers."""
        if not isinstance(other, MMKeyECWorkerMetadata):
            return self
        return MMKeyECWorkerMetadata(self.failed | other.failed)


_STAT_NAMES = (
    "lookups",
    "found",
    "loads",
    "loaded",
    "load_failures",
    "saves",
    "saved",
    "save_failures",
    "saves_dropped",
    "store_errors",
)


@dataclass
class MMKeyECStats(ECConnectorStats):
    """Counters of an interval, summed over workers and the scheduler (vLLM logs them).

    ``lookups``/``found``: identifiers asked by the scheduler and found; ``loads``/``loaded``/
    ``load_failures``: worker reads; ``saves``/``saved``/``save_failures``/``saves_dropped``:
    worker writes (dropped: over the pending budget); ``store_errors``: failed store calls.
    """

    def reset(self) -> None:
        """Zero every counter."""
        self.data.clear()

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        """Sum the counters of `other` into these."""
        for name, value in other.data.items():
            if isinstance(value, (int, float)):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, plus ``hit_rate`` (found over lookups) when there were lookups."""
        out: dict[str, int | float] = {
            n: v for n, v in self.data.items() if isinstance(v, (int, float)) and v
        }
        lookups = self.data.get("lookups", 0)
        if lookups:
            out["hit_rate"] = round(self.data.get("found", 0) / lookups, 4)
        return out

    def is_empty(self) -> bool:
        """Whether no counter moved."""
        return not any(self.data.get(n) for n in _STAT_NAMES)


# -- shared parts -------------------------------------------------------------------------------


_MEMORY_CACHES: dict[tuple[str, int], tuple[MemoryCache, int]] = {}
_MEMORY_LOCK = threading.Lock()


def _acquire_memory_cache(namespace: str, max_bytes: int) -> MemoryCache:
    """One `MemoryCache` per namespace and budget in this process, shared by both sides."""
    with _MEMORY_LOCK:
        cache, users = _MEMORY_CACHES.get((namespace, max_bytes), (None, 0))
        if cache is None:
            cache = MemoryCache(max_bytes)
        _MEMORY_CACHES[(namespace, max_bytes)] = (cache, users + 1)
        return cache


def _release_memory_cache(namespace: str, max_bytes: int) -> None:
    with _MEMORY_LOCK:
        cache, users = _MEMORY_CACHES.pop((namespace, max_bytes), (None, 0))
        if cache is None:
            return
        if users > 1:
            _MEMORY_CACHES[(namespace, max_bytes)] = (cache, users - 1)
        else:
            cache.close()


# -- the connector --------------------------------------------------------------------------------


class MMKeyECConnector(ECConnectorBase):
    """vLLM's encoder-cache connector slot, filled with an mmkey cache.

    Scheduler side: `ensure_cache_available` asks the store about all of a request's items in
    one call, `has_cache_item` answers from that (or asks itself), `update_state_after_alloc`
    plans loads (consumers) and records modalities for saves (producers), and
    `build_connector_meta` hands the plan to the workers. Worker side: `start_load_caches`
    loads planned hits onto the worker's device, verified and checked against the expected
    number of embeddings; `save_caches` queues new outputs for a background save.
    Failures are misses; a worker's failed loads come back to the scheduler side, which then
    stops claiming those identifiers for a while and reports the requests through
    `take_unavailable_requests` (vLLM fails them with a retryable error).
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        assert transfer is not None  # ECConnectorBase refuses a config without one
        self._settings = ConnectorSettings.from_extra_config(transfer.ec_connector_extra_config)
        self._namespace = self._settings.namespace or namespace_from_vllm_config(vllm_config)
        self._counts = Counters()
        self._warn = RateLimitedLog(
            logger,
            logging.WARNING,
            "MMKeyECConnector: %s%s; serving misses (the encoder runs)",
            period=_WARN_EVERY_S,
        )
        self._keys: dict[tuple[str, Modality], EmbeddingKey] = {}
        self._closed = False
        self._cache = self._open_cache(role)
        self._saver: BackgroundSaver | None = None
        if role is ECConnectorRole.WORKER and self.is_producer:
            self._saver = BackgroundSaver(
                self._cache,
                self._settings.max_pending_save_bytes,
                on_failure=lambda message: self._warn("save", message),
                name="mmkey-vllm-saver",
            )
        # scheduler side
        self._modalities: OrderedDict[str, Modality] = OrderedDict()
        self._found: dict[str, Modality] = {}  # answers of the current scheduling step
        self._missing: set[str] = set()
        self._loads: dict[str, LoadItem] = {}
        self._saves: dict[str, Modality] = {}
        self._unavailable: dict[str, float] = {}  # identifier -> until (monotonic)
        self._loading_requests: OrderedDict[str, set[str]] = OrderedDict()
        self._failed_requests: set[str] = set()
        # worker side
        self._device: torch.device | None = None
        self._failed_loads: set[str] = set()
        self._saver_seen = (0, 0, 0)
        self._entry_bytes = 8 << 20  # a guess until the first entry is read

    @property
    def namespace(self) -> str:
        """The namespace of every key this connector reads and writes."""
        return self._namespace

    @property
    def cache(self) -> EmbeddingCache:
        """The mmkey cache behind this connector."""
        return self._cache

    def key(self, identifier: str, modality: Modality) -> EmbeddingKey:
        """The key of a vLLM identifier under this connector's namespace."""
        return self.keys([(identifier, modality)])[0]

    def keys(self, items: Sequence[tuple[str, Modality]]) -> list[EmbeddingKey]:
        """Keys of (identifier, modality) pairs, built together and remembered a while."""
        memo = self._keys
        missing: dict[Modality, list[str]] = {}
        for identifier, modality in items:
            if (identifier, modality) not in memo:
                missing.setdefault(modality, []).append(identifier)
        for modality, identifiers in missing.items():
            unique = list(dict.fromkeys(identifiers))
            for identifier, key in zip(unique, identifier_keys(self._namespace, modality, unique)):
                memo[(identifier, modality)] = key
        keys = [memo[item] for item in items]
        while len(memo) > _MAX_TRACKED:
            del memo[next(iter(memo))]  # the oldest
        return keys

    def totals(self) -> dict[str, int]:
        """Every counter since this connector was made (the stats hooks give intervals)."""
        self._take_saver_counts()
        return self._counts.totals()

    def _open_cache(self, role: ECConnectorRole) -> EmbeddingCache:
        settings = self._settings
        if settings.store is StoreKind.MEMORY:
            return _acquire_memory_cache(self._namespace, settings.memory_max_bytes)
        # The scheduler side only asks what exists: a pure client that lends no memory.
        config = settings.mooncake_config(pure_client=role is ECConnectorRole.SCHEDULER)
        return MooncakeCache(config)

    # -- failures -------------------------------------------------------------------------------

    def _errors(self) -> int:
        try:
            return self._cache.stats().errors
        except Exception:
            return 0

    def _note_store_errors(self, before: int, what: str) -> None:
        errors = self._errors() - before
        if errors > 0:
            self._counts.add(store_errors=errors)
            self._warn(what, f"the store failed during {what} ({self._cache!r})")

    # -- scheduler side -------------------------------------------------------------------------

    def _remember(self, identifier: str, modality: Modality) -> None:
        self._modalities[identifier] = modality
        self._modalities.move_to_end(identifier)
        if len(self._modalities) > _MAX_TRACKED:
            self._modalities.popitem(last=False)

    def _blocked(self, identifier: str) -> bool:
        until = self._unavailable.get(identifier)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._unavailable[identifier]
        return False

    def _lookup(self, items: dict[str, tuple[Modality, ...]]) -> None:
        """Ask the store about each identifier under its candidate modalities, in one call."""
        owners: list[tuple[str, Modality]] = []
        for identifier, modalities in items.items():
            if self._blocked(identifier):
                self._missing.add(identifier)
                continue
            owners += [(identifier, modality) for modality in modalities]
        if not owners:
            return
        keys = self.keys(owners)
        before = self._errors()
        try:
            present = self._cache.batch_is_exist(keys)
        except Exception as exc:
            present = [False] * len(keys)
            self._counts.add(store_errors=1)
            self._warn("lookup", f"batch_is_exist raised {type(exc).__name__}: {exc}")
        else:
            self._note_store_errors(before, "lookup")
        for (identifier, modality), hit in zip(owners, present):
            if hit:
                self._found[identifier] = modality
        for identifier in items:
            if identifier not in self._found:
                self._missing.add(identifier)
        self._counts.add(lookups=len(items), found=sum(i in self._found for i in items))

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Look up the request's items still ahead of `num_computed_tokens` in one store call.

        Never defers the request. Items already behind the computed tokens (a request in
        decode) are not asked about again.
        """
        wanted: dict[str, tuple[Modality, ...]] = {}
        for feature in request.mm_features:
            modality = modality_of(feature.modality)
            position = feature.mm_position
            if modality is None or position.offset + position.length <= num_computed_tokens:
                continue
            self._remember(feature.identifier, modality)
            if feature.identifier not in self._found and feature.identifier not in self._missing:
                wanted[feature.identifier] = (modality,)
        if wanted:
            self._lookup(wanted)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """Whether the store holds an entry for `identifier` (within the cache's deadline)."""
        if identifier in self._found:
            return True
        if identifier in self._missing:
            return False
        modality = self._modalities.get(identifier)
        self._lookup({identifier: (modality,) if modality is not None else _ALL_MODALITIES})
        return identifier in self._found

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Plan a load for a found item (consumers); note the modality of one to save."""
        feature = request.mm_features[index]
        identifier = feature.identifier
        found = self._found.get(identifier)
        if found is not None:
            if self.is_consumer:
                self._loads[identifier] = LoadItem(
                    identifier, found, request.get_num_encoder_embeds(index)
                )
                requests = self._loading_requests.setdefault(identifier, set())
                requests.add(request.request_id)
                self._loading_requests.move_to_end(identifier)
                if len(self._loading_requests) > _MAX_TRACKED:
                    self._loading_requests.popitem(last=False)
            return
        modality = modality_of(feature.modality)
        if self.is_producer and modality is not None:
            self._saves[identifier] = modality

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's loads and saves; starts the next step with no remembered answers."""
        meta = MMKeyECMetadata(tuple(self._loads.values()), dict(self._saves))
        self._loads.clear()
        self._saves.clear()
        self._found.clear()
        self._missing.clear()
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """Take the workers' failed loads: stop claiming them, fail their requests (retryable)."""
        meta = connector_output.ec_connector_worker_meta
        if not isinstance(meta, MMKeyECWorkerMetadata) or not meta.failed:
            return
        now = time.monotonic()
        for identifier in meta.failed:
            self._unavailable[identifier] = now + _UNAVAILABLE_FOR_S
            self._failed_requests |= self._loading_requests.pop(identifier, set())
        if len(self._unavailable) > _MAX_TRACKED:  # forget the expired ones, then the oldest
            live = {i: t for i, t in self._unavailable.items() if t > now}
            self._unavailable = dict(list(live.items())[-_MAX_TRACKED:])

    def take_unavailable_requests(self) -> set[str]:
        """Requests whose planned load failed on a worker; vLLM fails them (retryable)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Saves hold their own tensor references, so vLLM may free now."""
        for feature in request.mm_features:
            requests = self._loading_requests.get(feature.identifier)
            if requests is not None:
                requests.discard(request.request_id)
                if not requests:
                    del self._loading_requests[feature.identifier]
        self._failed_requests.discard(request.request_id)
        return False, None

    # -- worker side ------------------------------------------------------------------------------

    def _worker_device(self) -> torch.device:
        if self._device is None:
            from vllm.platforms import current_platform

            if current_platform.is_cuda_alike():
                self._device = torch.device(current_platform.device_type, torch.cuda.current_device())
            else:
                self._device = torch.device(current_platform.device_type)
        return self._device

    def _metadata(self) -> MMKeyECMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, MMKeyECMetadata) else None

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Load this step's planned hits into `encoder_cache`, on this worker's device.

        An entry that is missing, fails verification, has another number of rows than the
        scheduler expects, or cannot be read is not inserted and is reported back.
        """
        meta = self._metadata()
        if meta is None or not meta.loads:
            return
        wanted = [item for item in meta.loads if item.identifier not in encoder_cache]
        if not wanted:
            return
        device = self._worker_device()
        loaded = 0
        start = 0
        while start < len(wanted):
            # reads of at most about _LOAD_CHUNK_BYTES each, so that every call fits the deadline
            chunk = wanted[start : start + max(1, _LOAD_CHUNK_BYTES // self._entry_bytes)]
            start += len(chunk)
            for item, tensor in zip(chunk, self._read(chunk)):
                if tensor is not None:
                    self._entry_bytes = max(tensor.numel() * tensor.element_size(), 1)
                if tensor is None or tensor.ndim < 1 or tensor.shape[0] != item.num_embeds:
                    if tensor is not None:
                        self._warn(
                            "shape",
                            f"entry for {item.identifier!r} has shape {tuple(tensor.shape)}, "
                            f"expected {item.num_embeds} rows",
                        )
                    self._failed_loads.add(item.identifier)
                    continue
                encoder_cache[item.identifier] = tensor.to(device)
                loaded += 1
        self._counts.add(loads=len(wanted), loaded=loaded, load_failures=len(wanted) - loaded)

    def _read(self, items: list[LoadItem]) -> list[torch.Tensor | None]:
        keys = self.keys([(item.identifier, item.modality) for item in items])
        before = self._errors()
        try:
            tensors = self._cache.get_embeddings(keys)
        except Exception as exc:
            self._counts.add(store_errors=1)
            self._warn("load", f"get_embeddings raised {type(exc).__name__}: {exc}")
            return [None] * len(keys)
        self._note_store_errors(before, "load")
        return tensors

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Queue the new encoder output of `mm_hash` for a background save (producers only).

        Returns at once: over the pending budget, or for a modality the scheduler did not
        name, the save is dropped and counted.
        """
        if self._saver is None:
            return
        meta = self._metadata()
        modality = meta.saves.get(mm_hash) if meta is not None else None
        tensor = encoder_cache.get(mm_hash)
        if modality is None or tensor is None:
            self._counts.add(saves_dropped=1)
            return
        self._counts.add(saves=1)
        self._saver.submit(self.key(mm_hash, modality), tensor)  # the saver counts drops

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing to report: loads finish within the step and saves hold their own tensors."""
        return None, None

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        """This step's failed loads, for the scheduler side; ``None`` when every load worked."""
        if not self._failed_loads:
            return None
        failed, self._failed_loads = frozenset(self._failed_loads), set()
        return MMKeyECWorkerMetadata(failed)

    def flush_saves(self, timeout: float) -> bool:
        """Wait up to `timeout` s until the queued saves are written; ``True`` when none is left."""
        return self._saver.flush(timeout) if self._saver is not None else True

    # -- stats and shutdown -----------------------------------------------------------------------

    def _take_saver_counts(self) -> None:
        if self._saver is None:
            return
        counts = self._saver.counts()
        seen = self._saver_seen
        self._saver_seen = (counts.saved, counts.failed, counts.dropped)
        self._counts.add(
            saved=counts.saved - seen[0],
            save_failures=counts.failed - seen[1],
            saves_dropped=counts.dropped - seen[2],
        )

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        """This interval's counters (see `MMKeyECStats`), or ``None`` when nothing happened."""
        self._take_saver_counts()
        data = self._counts.take()
        return MMKeyECStats(data=dict(data)) if data else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats | None:
        """vLLM's hook to rebuild the stats of this connector from their ``data``."""
        return MMKeyECStats(data=dict(data or {}))

    def shutdown(self) -> None:
        """Finish queued saves (up to 5 s), then close the cache. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._saver is not None:
            self._saver.close(_SHUTDOWN_WAIT_S)
        if self._settings.store is StoreKind.MEMORY:
            _release_memory_cache(self._namespace, self._settings.memory_max_bytes)
        else:
            self._cache.close()
