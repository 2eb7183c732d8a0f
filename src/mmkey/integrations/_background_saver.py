"""`BackgroundSaver`: writes embeddings to a cache on one thread, never blocking the caller.

The caller's thread only records when its tensors are ready (a CUDA event per device, nothing
for CPU tensors) and queues them; the saver thread waits for that point, then writes every
queued entry with one `insert_batch`. Queued tensors are bounded by bytes: past the budget a
save is dropped (counted), never waited for. With a hold (`hold_s`), a save waits until the
caller says its work is past (`release_held`: vLLM's next engine step) or `hold_s` has passed,
so that writing it does not take the CPU from the request that produced it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from mmkey._tensors import HostReady, host_ready
from mmkey.cache.protocol import EmbeddingCache
from mmkey.keys import CacheKey

if TYPE_CHECKING:
    import torch

__all__ = ["HOLD_POLL_S", "MAX_HOLD_S", "BackgroundSaver", "SaverCounts"]

MAX_HOLD_S = 1.0
"""The longest hold a saver takes: a held save delays its entry for every other reader."""
HOLD_POLL_S = 0.01
"""How often the saver thread looks at its clock while it holds saves (and nothing else
wakes it)."""


@attrs.frozen(slots=True)
class SaverCounts:
    """What a `BackgroundSaver` did since it was made; a snapshot."""

    saved: int = 0
    """Entries the cache reported as stored."""
    failed: int = 0
    """Entries the cache did not store (a store fault, a refused insert, an exception)."""
    dropped: int = 0
    """Saves refused at once: the pending budget was full, or the saver was closed."""
    skipped: int = 0
    """Saves not written because the cache already held the key (checked before writing)."""
    pending_bytes: int = 0
    """Bytes of tensors queued or being written now."""
    held: int = 0
    """Saves queued and held now (waiting for `BackgroundSaver.release_held` or their hold)."""


@attrs.define(slots=True)
class _Job:
    key: CacheKey
    text: str
    tensor: torch.Tensor
    nbytes: int
    ready: HostReady
    due: float
    """When its hold ends (the saver's clock); 0.0 once released."""


def _storage_bytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except Exception:  # tensors without storage (meta, some subclasses)
        return 0


class BackgroundSaver:
    """Saves (key, tensor) pairs to `cache` on a daemon thread, within `max_pending_bytes`.

    Queued saves are written together, in `insert_batch` calls of at most `max_batch_bytes`.
    `on_failure(message)` is called on the saver thread for every failed call (the caller
    rate-limits its logging); it must not raise. `on_done(texts)`, where given, is called with
    the key texts of every save that finished (written, skipped, failed, dropped at `close`),
    on the saver thread; it must not raise. `hold_s` > 0: a save is written only after
    `release_held` (or `flush`, `close`) or once `hold_s` has passed on `clock` since it was
    queued, whichever comes first (its absolute bound; the thread looks at the clock at least
    every `HOLD_POLL_S` while it holds saves).
    """

    def __init__(
        self,
        cache: EmbeddingCache,
        max_pending_bytes: int,
        on_failure: Callable[[str], None] = lambda _: None,
        name: str = "mmkey-saver",
        max_batch_bytes: int = 64 << 20,
        on_done: Callable[[list[str]], None] | None = None,
        *,
        hold_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        hold: object = hold_s
        if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold <= MAX_HOLD_S:
            raise ValueError(f"hold_s must be seconds within 0-{MAX_HOLD_S}, got {hold_s!r}")
        if isinstance(max_pending_bytes, bool) or not isinstance(max_pending_bytes, int):
            raise TypeError(f"max_pending_bytes must be an int, got {max_pending_bytes!r}")
        if max_pending_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be > 0, got {max_pending_bytes}")
        self._cache = cache
        self._budget = max_pending_bytes
        self._batch_bytes = max_batch_bytes
        self._on_failure = on_failure
        self._on_done = on_done
        self._hold = float(hold_s)
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._queued_texts: set[str] = set()
        self._pending_bytes = 0
        self._busy = False
        self._closed = False
        self._saved = self._failed = self._dropped = self._skipped = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: CacheKey, tensor: torch.Tensor) -> bool:
        """Queue one save; ``False`` when it was dropped (budget full or closed). Never waits.

        A key already queued is not queued twice.
        """
        text = key.to_key()
        # a view pins all of its storage until the save is written: that is what counts
        nbytes = max(tensor.numel() * tensor.element_size(), _storage_bytes(tensor))
        ready = host_ready([tensor])
        with self._cond:
            if text in self._queued_texts:
                return True
            if self._closed or self._pending_bytes + nbytes > self._budget:
                self._dropped += 1
                return False
            self._queue.append(
                _Job(key, text, tensor, nbytes, ready, self._clock() + self._hold if self._hold else 0.0)
            )
            self._queued_texts.add(text)
            self._pending_bytes += nbytes
            self._cond.notify_all()
        return True

    def release_held(self) -> None:
        """Let every save queued so far be written now (their producer's work is past)."""
        with self._cond:
            held = False
            for job in self._queue:
                held |= job.due > 0.0
                job.due = 0.0
            if held:
                self._cond.notify_all()

    def counts(self) -> SaverCounts:
        """A snapshot of this saver's counters."""
        with self._cond:
            held = sum(1 for job in self._queue if job.due > 0.0)
            return SaverCounts(
                self._saved, self._failed, self._dropped, self._skipped, self._pending_bytes, held
            )

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until every queued save (held ones too) has been
        written or failed."""
        self.release_held()
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Stop taking saves, finish the queued ones for up to `timeout` s; whether all finished.

        Saves still queued after the timeout are dropped (the thread is a daemon).
        """
        finished = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._dropped += len(self._queue)
            dropped = [job.text for job in self._queue]
            self._queue.clear()
            self._cond.notify_all()
        if dropped and self._on_done is not None:
            self._on_done(dropped)
        if finished:
            self._thread.join(timeout)
        return finished

    def _run(self) -> None:
        while True:
            with self._cond:
                batch = self._take_due()
                while not batch and not self._closed:
                    self._cond.wait(self._next_look() if self._queue else None)
                    batch = self._take_due()
                if not batch:  # closed: close() has dropped what was still queued
                    return
                self._busy = True
            batch, skipped = self._without_existing(batch)
            ok = sum(self._write(batch))
            batch_texts = [job.text for job in batch]
            texts = batch_texts + [job.text for job in skipped]
            nbytes = sum(job.nbytes for job in batch) + sum(job.nbytes for job in skipped)
            n_skipped = len(skipped)
            batch.clear()
            skipped.clear()  # release the tensors before anyone is told they are written
            if self._on_done is not None:  # before a flush that waits for them returns
                self._on_done(texts)
            with self._cond:
                self._saved += ok
                self._failed += len(batch_texts) - ok
                self._skipped += n_skipped
                self._queued_texts.difference_update(texts)
                self._pending_bytes -= nbytes
                self._busy = False
                self._cond.notify_all()

    def _next_look(self) -> float:
        """Seconds until the first held job is due, at most `HOLD_POLL_S` (under the lock)."""
        return max(0.0, min(HOLD_POLL_S, min(job.due for job in self._queue) - self._clock()))

    def _take_due(self) -> list[_Job]:
        """The queued jobs whose hold is over, taken off the queue (under the lock)."""
        if not self._queue:
            return []
        now = self._clock()
        due = [job for job in self._queue if job.due <= now]
        if len(due) < len(self._queue):
            self._queue = [job for job in self._queue if job.due > now]
        else:
            self._queue = []
        return due

    def _without_existing(self, batch: list[_Job]) -> tuple[list[_Job], list[_Job]]:
        """Split `batch` into (to write, already stored); a failed check writes them all."""
        try:
            present = self._cache.batch_is_exist([job.key for job in batch])
        except Exception:
            return batch, []
        if len(present) != len(batch):
            return batch, []
        return (
            [job for job, p in zip(batch, present, strict=True) if not p],
            [job for job, p in zip(batch, present, strict=True) if p],
        )

    def _write(self, batch: list[_Job]) -> list[bool]:
        """Write `batch` in `insert_batch` calls of at most `max_batch_bytes` (one entry at least),
        so that each call fits a store's timeout."""
        stored: list[bool] = []
        start = 0
        while start < len(batch):
            end, size = start + 1, batch[start].nbytes
            while end < len(batch) and size + batch[end].nbytes <= self._batch_bytes:
                size += batch[end].nbytes
                end += 1
            stored += self._write_chunk(batch[start:end])
            start = end
        return stored

    def _write_chunk(self, chunk: list[_Job]) -> list[bool]:
        try:
            for job in chunk:
                job.ready.wait()
            stored = self._cache.insert_batch([j.key for j in chunk], [j.tensor for j in chunk])
        except Exception as exc:  # a cache fault is a failed save, never the worker's problem
            self._on_failure(f"{len(chunk)} embedding save(s) raised {type(exc).__name__}: {exc}")
            return [False] * len(chunk)
        failed = len(chunk) - sum(stored)
        if failed:
            self._on_failure(f"{failed} of {len(chunk)} embedding save(s) were not stored")
        return stored
