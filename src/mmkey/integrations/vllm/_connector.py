"""`MMKeyECConnector`: the class vLLM loads into its encoder-cache connector slot. It opens
the cache, then hands each hook to its side (`SchedulerSide`, `WorkerSide`), and gathers
their counters for vLLM's stats. Importing it checks vLLM's connector API."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

from mmkey._log import Counters, RateLimitedLog
from mmkey.cache.memory import MemoryCache
from mmkey.cache.mooncake import MooncakeCache
from mmkey.cache.protocol import EmbeddingCache
from mmkey.digest import Modality
from mmkey.entry.auth import EntryKeyring
from mmkey.integrations.vllm._api import check_connector_api
from mmkey.integrations.vllm._connector_settings import ConnectorSettings, StoreKind
from mmkey.integrations.vllm._metadata import MMKeyECMetadata, MMKeyECStats
from mmkey.integrations.vllm._namespace import check_identifiers, namespace_from_vllm_config
from mmkey.integrations.vllm._scheduler import SchedulerSide
from mmkey.integrations.vllm._worker import WorkerSide
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = ["MMKeyECConnector"]

logger: logging.Logger = logging.getLogger(__name__)

check_connector_api()

_WARN_EVERY_S = 60.0
_clock: Callable[[], float] = time.monotonic
"""The clock every wait of the scheduler side is timed by (a test moves its own)."""


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


def _keyring_of(cache: EmbeddingCache) -> EntryKeyring | None:
    """The fleet's entry secrets of a store cache (they sign announcements), if any."""
    keyring = getattr(cache, "keyring", None)
    return keyring if isinstance(keyring, EntryKeyring) else None


class MMKeyECConnector(ECConnectorBase):
    """vLLM's encoder-cache connector slot, filled with an mmkey cache.

    Scheduler side: `ensure_cache_available` starts fetches of a request's items (verified,
    into host memory this side owns) and defers the request until each is staged or known
    missing, at most the store's timeout (or ``producer_wait_s`` for items a producer
    announced, ``claim_wait`` for items another instance claimed and is encoding: producers
    claim what they encode, single-flight); `has_cache_item` is ``True`` only for staged
    items, so a load can no longer fail after the scheduler planned it.
    `update_state_after_alloc` hands staged tensors to the step's metadata (consumers) or plans
    saves (producers). Worker side:
    `start_load_caches` moves the staged tensors to the device; `save_caches` queues new
    outputs for a background save (tensor-parallel rank 0 only; stored keys are skipped), and
    `build_connector_worker_meta` tells the scheduler side which saves are done
    (`update_connector_output` ends their claims).
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        assert transfer is not None  # ECConnectorBase refuses a config without one
        self._settings = ConnectorSettings.from_extra_config(transfer.ec_connector_extra_config)
        check_identifiers(vllm_config, explicit_namespace=self._settings.namespace is not None)
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
        self._seen: dict[str, tuple[int, ...]] = {}
        self._scheduler = SchedulerSide(
            self._cache,
            self._namespace,
            self._settings,
            stage=role is ECConnectorRole.SCHEDULER,
            consumer=self.is_consumer,
            producer=self.is_producer,
            counts=self._counts,
            warn=self._warn,
            keyring=_keyring_of(self._cache),
            clock=_clock,
        )
        self._worker = WorkerSide(
            self._cache,
            self._settings.max_pending_save_bytes,
            save=role is ECConnectorRole.WORKER and self.is_producer,
            counts=self._counts,
            warn=self._warn,
            save_hold_s=self._settings.save_hold_s,
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
        """The key of an item vLLM sends without its data (no ``cache_salt``, no LoRA): its
        identifier's. An item with data is keyed by the digest of that data, every time."""
        return self._scheduler.key(identifier, modality)

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

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Start fetching the request's items ahead of ``num_computed_tokens``; ``False`` (vLLM
        tries again next step) while any is unanswered, for at most the store's timeout, or
        ``producer_wait_s`` for items a producer announced but the store does not hold yet,
        both from the request's first deferral."""
        return self._scheduler.ensure_cache_available(request, num_computed_tokens)

    def has_cache_item(self, identifier: str) -> bool:
        """Whether ``identifier``'s entry is staged here: fetched, verified, of the right size.

        Never calls the store: items not asked for by `ensure_cache_available` are misses.
        """
        return self._scheduler.has_cache_item(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Hand a staged item to this step's loads (consumers); plan the save of an item to
        encode (producers)."""
        self._scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's loads (staged tensors, handed over) and saves."""
        return self._scheduler.build_connector_meta()

    def update_state_after_free(self, request: Request, index: int) -> None:
        """vLLM freed an item of ``request``: release what is staged for it alone."""
        self._scheduler.update_state_after_free(request, index)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's staged items. A producer announces the keys it encoded for
        the request in its ``ec_transfer_params`` (``{"mmkey": {"encoded": [key, ...]}}``,
        signed with the fleet's entry secret where one is set), so a consumer handed them
        waits for those saves instead of encoding again."""
        return self._scheduler.request_finished(request)

    # -- worker side ------------------------------------------------------------------------------

    def _metadata(self) -> MMKeyECMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, MMKeyECMetadata) else None

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        """vLLM's worker begins a step (every step of a multimodal model): the saves of earlier
        steps are written from now on, off the step that encoded them."""
        super().bind_connector_metadata(connector_metadata)
        self._worker.step_started()

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Put this step's staged tensors into ``encoder_cache``, on this worker's device.

        The copies are asynchronous where the device allows (the staged memory is pinned):
        vLLM's next kernels on the stream wait for them.
        """
        self._worker.start_load_caches(self._metadata(), encoder_cache)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """Queue the new encoder output of `mm_hash` for a background save.

        Only tensor-parallel rank 0 of a producer saves. Returns at once: over the pending
        budget, or for an item the scheduler did not plan, the save is dropped and counted.
        """
        self._worker.save_caches(self._metadata(), encoder_cache, mm_hash)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        """The saves this worker finished since the last step (``None``: none, or no claims),
        so that the scheduler side releases their claims."""
        return self._worker.worker_meta()

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """Release the claims of the saves the workers finished, and those past their hold."""
        self._scheduler.update_connector_output(getattr(connector_output, "ec_connector_worker_meta", None))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing to report: loads finish within the step and saves hold their own tensors."""
        return None, None

    def flush_saves(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until the queued saves are written; ``True`` when none is
        left."""
        return self._worker.flush_saves(timeout)

    def _take_component_counts(self) -> None:
        """Move the saver's and stager's own counts (from their calls' results) into ours."""
        now: dict[str, tuple[int, ...]] = {}
        c = self._worker.saver_counts()
        if c is not None:
            now["saver"] = (c.saved, c.failed, c.dropped, c.skipped)
        s = self._scheduler.stager_counts()
        if s is not None:
            now["stager"] = (
                s.asked,
                s.staged,
                s.wrong_size,
                s.over_budget,
                s.store_errors,
                s.claims_won,
                s.claims_held,
            )
        names = {
            "saver": ("saved", "save_failures", "saves_dropped", "saves_skipped"),
            "stager": (
                "lookups",
                "found",
                "wrong_size",
                "over_budget",
                "store_errors",
                "claims_won",
                "claims_held",
            ),
        }
        for part, values in now.items():
            before = self._seen.get(part, (0,) * len(values))
            self._counts.add(**{n: v - b for n, v, b in zip(names[part], values, before, strict=True)})
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
        self._worker.close()
        self._scheduler.close()
        if self._settings.store is StoreKind.MEMORY:
            _release_memory_cache(self._namespace, self._settings.memory_max_bytes)
        else:
            self._cache.close()
