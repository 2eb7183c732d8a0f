"""`AsyncCache`: any `EmbeddingCache` as an `AsyncEmbeddingCache`, run off the event loop."""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from mmkey._tensors import HostReady, host_ready
from mmkey.cache._guard import insert_args, sync_cache
from mmkey.cache.protocol import CacheStats, EmbeddingCache
from mmkey.errors import StoreClosed
from mmkey.keys import CacheKey

if TYPE_CHECKING:
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


def _insert_copies(
    cache: EmbeddingCache,
    keys: Sequence[CacheKey],
    embeddings: Sequence[torch.Tensor],
    ready: HostReady,
    abandoned: threading.Event,
) -> list[bool]:
    """In the worker: copy the embeddings once they are ready, then insert the copies.

    Nothing is inserted once `abandoned` is set: a copy that may have read the caller's
    tensors after the caller stopped waiting is dropped.
    """
    _, tensors = insert_args(keys, embeddings)
    if abandoned.is_set():
        return [False] * len(tensors)
    ready.wait()
    owned = [t.detach().to("cpu", copy=True) for t in tensors]
    if abandoned.is_set():
        return [False] * len(tensors)
    return cache.insert_batch(keys, owned)


class AsyncCache:
    """Awaitable calls on a synchronous `cache`, each run in a worker thread.

    The event loop never waits on the cache's locks, hashing or store calls. Calls run in
    `executor`, or the loop's default executor when None. Argument checks happen in the
    worker, so errors surface from the ``await``. A cancelled call still finishes in its
    thread, but a cancelled `insert_batch` stores nothing read after its cancellation (see
    there). `close` closes the wrapped cache.
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

    async def _run(self, call: Callable[..., _T], *args: object) -> _T:
        if self._closed:
            raise StoreClosed("this AsyncCache is closed; create a new one")
        import asyncio  # not at `import mmkey`: it costs more than the rest together

        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        return await loop.run_in_executor(
            self._executor, functools.partial(context.run, call, *args)
        )

    async def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held, in order."""
        return await self._run(self._cache.batch_is_exist, _snapshot(keys))

    async def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The verified embedding of each key, or None for a miss, in order."""
        return await self._run(self._cache.get_embeddings, _snapshot(keys))

    async def insert_batch(
        self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]
    ) -> list[bool]:
        """Store one embedding per key; whether each is held afterwards.

        The worker stores CPU copies of the embeddings, taken once the caller's CUDA work
        on them is done (an event recorded here, on the caller's thread, on its current
        streams: see `mmkey._tensors.host_ready`), so output written on a side stream is
        never read early. If the call is cancelled, a copy finished before the cancellation
        may still be stored, but nothing the worker reads afterwards is: the caller may
        reuse its buffers as soon as the ``await`` raises `asyncio.CancelledError`.
        """
        keys, embeddings = _snapshot(keys), _snapshot(embeddings)
        ready = _ready(embeddings)
        abandoned = threading.Event()
        insert = functools.partial(_insert_copies, self._cache, keys, embeddings, ready, abandoned)
        try:
            return await self._run(insert)
        except BaseException:  # cancelled (or interrupted): the caller owns its tensors again
            abandoned.set()
            raise

    async def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """Bring the keys as close as the cache can; how many are now held nearby."""
        return await self._run(self._cache.prefetch, _snapshot(keys))

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
