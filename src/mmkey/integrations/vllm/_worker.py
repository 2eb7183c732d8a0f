"""The connector's worker side: moves the tensors the scheduler side staged onto this
worker's device, and saves new encoder outputs on a background thread within a byte budget
(tensor-parallel rank 0 of a producer only), telling the scheduler side which saves are done
where it claims what it encodes (`MMKeyECWorkerMetadata`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from mmkey._log import Counters
from mmkey.cache.protocol import EmbeddingCache
from mmkey.integrations._background_saver import BackgroundSaver, SaverCounts
from mmkey.integrations.vllm._metadata import MMKeyECMetadata, MMKeyECWorkerMetadata
from mmkey.integrations.vllm._stager import claim_wait_of

__all__ = ["WorkerSide", "tensor_parallel_rank"]

_SHUTDOWN_WAIT_S = 5.0
_MAX_REPORTED = 4096


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank; 0 where vLLM's parallel state is not set up."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


class WorkerSide:
    """The worker hooks of `MMKeyECConnector` (see the connector). `save`: whether this
    worker saves (a producer's worker); only tensor-parallel rank 0 of them does. A save waits
    for the step that encoded it to end (`step_started`), at most `save_hold_s`."""

    def __init__(
        self,
        cache: EmbeddingCache,
        max_pending_save_bytes: int,
        *,
        save: bool,
        counts: Counters,
        warn: Callable[[str, str], None],
        save_hold_s: float = 0.0,
    ) -> None:
        self._counts = counts
        self._device: torch.device | None = None
        self._saver: BackgroundSaver | None = None
        self._done_lock = threading.Lock()
        self._done: set[str] = set()
        """Key texts whose saves finished since the last step's report (claims on only)."""
        if save and tensor_parallel_rank() == 0:
            report = claim_wait_of(cache) > 0
            self._saver = BackgroundSaver(
                cache,
                max_pending_save_bytes,
                on_failure=lambda message: warn("save", message),
                name="mmkey-vllm-saver",
                on_done=self._finished if report else None,
                hold_s=save_hold_s,
            )
        self._report = self._saver is not None and claim_wait_of(cache) > 0

    def _finished(self, texts: list[str]) -> None:
        with self._done_lock:
            self._done.update(texts)
            if len(self._done) > _MAX_REPORTED:  # no step has taken them: their holds end them
                self._done = set(list(self._done)[-_MAX_REPORTED:])

    def _worker_device(self) -> torch.device:
        if self._device is None:
            from vllm.platforms import current_platform

            if current_platform.is_cuda_alike():
                self._device = torch.device(current_platform.device_type, torch.cuda.current_device())
            else:
                self._device = torch.device(current_platform.device_type)
        return self._device

    def step_started(self) -> None:
        """A new engine step began: the saves queued in earlier steps are written now."""
        if self._saver is not None:
            self._saver.release_held()

    def start_load_caches(self, meta: MMKeyECMetadata | None, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Put this step's staged tensors into ``encoder_cache``, on this worker's device.

        The copies are asynchronous where the device allows (the staged memory is pinned):
        vLLM's next kernels on the stream wait for them.
        """
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
        self, meta: MMKeyECMetadata | None, encoder_cache: dict[str, torch.Tensor], mm_hash: str
    ) -> None:
        """Queue the new encoder output of `mm_hash` for a background save (see the connector)."""
        if self._saver is None:
            return
        key = meta.saves.get(mm_hash) if meta is not None else None
        tensor = encoder_cache.get(mm_hash)
        if key is None or tensor is None:
            self._counts.add(saves_dropped=1)
            if key is not None and self._report:
                self._finished([key.to_key()])
            return
        self._counts.add(saves=1)
        if not self._saver.submit(key, tensor) and self._report:  # the saver counts drops
            self._finished([key.to_key()])

    def worker_meta(self) -> MMKeyECWorkerMetadata | None:
        """The saves finished since the last call, for the scheduler side (``None``: none)."""
        if not self._report:
            return None
        with self._done_lock:
            done, self._done = self._done, set()
        return MMKeyECWorkerMetadata(frozenset(done)) if done else None

    def flush_saves(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until the queued saves are written; ``True`` when none is left."""
        return self._saver.flush(timeout) if self._saver is not None else True

    def saver_counts(self) -> SaverCounts | None:
        """The saver's own counts (``None`` where this worker saves nothing)."""
        return None if self._saver is None else self._saver.counts()

    def close(self) -> None:
        """Finish queued saves (up to 5 s)."""
        if self._saver is not None:
            self._saver.close(_SHUTDOWN_WAIT_S)
