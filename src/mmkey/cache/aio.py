"""`AsyncCache`: any `EmbeddingCache` as an `AsyncEmbeddingCache`, run off the event loop."""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from mmkey._tensors import HostReady, host_ready
from mmkey.cache._guard import sync_cache
from mmkey.cache.protocol import CacheStats, Claim, ClaimingCache, EmbeddingCache
from mmkey.errors import StoreClosed
from mmkey.keys import CacheKey

if TYPE_CHECKING:
    import asyncio
    from concurrent.futures import Executor

    import torch

__all__ = ["AsyncCache"]

_T = TypeVar("_T")


def _snapshot(items: Sequence[_T]) -> Sequence[_T]:
    """A list argument frozen to a tuple, so the caller may reuse it while the call runs."""
    return tuple(items) if isinstance(items, list) else items


def _ready(embeddings: object) -> HostReady:
    """`host_ready` of an insert's embeddings; nothing for malformed input (refused later)."""
    if isinstance(embeddings, (list, tuple)):
        return host_ready(embeddings)
    return HostReady()


class _Insert:
    """One `insert_batch` handed to a worker: it reads the caller's tensors only while it runs.

    `run` (in the worker) waits for the caller's CUDA work, then inserts. `abandon` (on the
    caller's side) stops it if it has not started yet, and says whether it had.
    """

    __slots__ = ("_abandoned", "_cache", "_embeddings", "_keys", "_lock", "_ready", "_started")

    def __init__(
        self,
        cache: EmbeddingCache,
        keys: Sequence[CacheKey],
        embeddings: Sequence[torch.Tensor],
        ready: HostReady,
    ) -> None:
        self._cache, self._keys, self._embeddings, self._ready = cache, keys, embeddings, ready
        self._lock = threading.Lock()
        self._started = self._abandoned = False

    def run(self) -> list[bool]:
        """In the worker: the wrapped insert, once the caller's streams are done (if wanted)."""
        with self._lock:
            if self._abandoned:
                return []
            self._started = True
        self._ready.wait()
        return self._cache.insert_batch(self._keys, self._embeddings)

    def abandon(self) -> bool:
        """Never start; whether it had already started (it then reads until it returns)."""
        with self._lock:
            self._abandoned = True
            return self._started


async def _settled(future: asyncio.Future[list[bool]]) -> None:
    """Wait until `future` is done, through any further cancellation; drop its outcome."""
    import asyncio

    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue
    if not future.cancelled():
        future.exception()  # retrieved: an abandoned call's failure is nobody's to raise


class AsyncCache:
    """Awaitable calls on a synchronous `cache`, each run in a worker thread.

    The event loop never waits on the cache's locks, hashing or store calls. Calls run in
    ``executor``, or the loop's default executor when None. Argument checks happen in the
    worker, so errors surface from the ``await``. A cancelled read still finishes in its
    thread; a cancelled `insert_batch` returns only once its worker stopped reading the
    caller's tensors (see there). `close` closes the wrapped cache.
    """

    def __init__(self, cache: EmbeddingCache, *, executor: Executor | None = None) -> None:
        self._cache = sync_cache(cache, "cache")
        self._executor = executor
        self._closed = False

    @property
    def cache(self) -> EmbeddingCache:
        """The wrapped synchronous cache."""
        return self._cache

    def __repr__(self) -> str:
        return f"AsyncCache({self._cache!r})"

    def _submit(self, call: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        if self._closed:
            raise StoreClosed("this AsyncCache is closed; create a new one")
        import asyncio  # not at `import mmkey`: it costs more than the rest together

        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        return loop.run_in_executor(self._executor, functools.partial(context.run, call, *args))

    async def _run(self, call: Callable[..., _T], *args: object) -> _T:
        return await self._submit(call, *args)

    async def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held, in order."""
        return await self._run(self._cache.batch_is_exist, _snapshot(keys))

    async def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The verified embedding of each key, or None for a miss, in order."""
        return await self._run(self._cache.get_embeddings, _snapshot(keys))

    async def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        """Store one embedding per key; whether each is held afterwards.

        The worker reads CUDA embeddings only once the caller's work on them is done: an
        event is recorded here, on the caller's thread, on its current streams (see
        ``mmkey._tensors.host_ready``), so output written on a side stream is never stored
        early. Cancelled before its worker started, the insert never runs; cancelled while
        it runs, the ``await`` raises `asyncio.CancelledError` only once the wrapped insert
        has returned (no longer than that cache's own timeout). Either way the caller may
        reuse its buffers as soon as the ``await`` raised: no copy is taken.
        """
        import asyncio

        keys, embeddings = _snapshot(keys), _snapshot(embeddings)
        job = _Insert(self._cache, keys, embeddings, _ready(embeddings))
        pending = self._submit(job.run)
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            if job.abandon():
                await _settled(pending)
            raise
        except BaseException:
            job.abandon()
            raise

    async def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """Bring the keys as close as the cache can; how many are now held nearby."""
        return await self._run(self._cache.prefetch, _snapshot(keys))

    @property
    def claim_wait(self) -> float:
        """The wrapped cache's ``claim_wait`` where it supports claims, else 0.0 (off)."""
        inner = self._cache
        return inner.claim_wait if isinstance(inner, ClaimingCache) else 0.0

    async def claim(self, keys: Sequence[CacheKey]) -> list[Claim]:
        """The wrapped cache's claims (`Claim.UNCLAIMED` for each key where it has none)."""
        inner = self._cache
        if not isinstance(inner, ClaimingCache):
            return [Claim.UNCLAIMED] * len(keys)
        return await self._run(inner.claim, _snapshot(keys))

    async def release(self, keys: Sequence[CacheKey]) -> None:
        """Release the wrapped cache's claims of the keys."""
        inner = self._cache
        if isinstance(inner, ClaimingCache):
            await self._run(inner.release, _snapshot(keys))

    async def wait_for_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The wrapped cache's bounded wait for keys claimed elsewhere, in a worker thread (it
        holds that thread for up to ``claim_wait`` seconds: size ``executor`` for the waits)."""
        inner = self._cache
        if not isinstance(inner, ClaimingCache):
            return [None] * len(keys)
        return await self._run(inner.wait_for_embeddings, _snapshot(keys))

    def stats(self) -> CacheStats:
        """A snapshot of the wrapped cache's counters, read directly (stats are cheap)."""
        if self._closed:
            raise StoreClosed("this AsyncCache is closed; create a new one")
        return self._cache.stats()

    async def close(self) -> None:
        """Close the wrapped cache in a worker thread; later calls raise `StoreClosed`."""
        if self._closed:
            return
        self._closed = True
        import asyncio

        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._cache.close)
