"""AsyncCache: the same cache, awaited from asyncio without ever blocking the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mmkey import (
    AsyncCache,
    AsyncEmbeddingCache,
    CacheKey,
    EmbeddingKey,
    HashScheme,
    MemoryCache,
    Modality,
    StoreClosed,
    mm_hash,
)


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("vit", Modality.VIDEO, HashScheme.BLAKE3, mm_hash(i))


class HeldReads(MemoryCache):
    """A MemoryCache whose reads set `entered`, then wait for `release` (at most 60 s; whether
    it came is kept in `released`), like a store that answers once the test lets it."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released: bool | None = None

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        self.thread = threading.current_thread().name
        self.entered.set()
        self.released = self.release.wait(timeout=60)
        return super().get_embeddings(keys)


def test_is_an_async_embedding_cache_over_any_embedding_cache() -> None:
    cache = AsyncCache(MemoryCache(1 << 20))
    assert isinstance(cache, AsyncEmbeddingCache)
    assert isinstance(cache.cache, MemoryCache)
    with pytest.raises(TypeError, match="EmbeddingCache"):
        AsyncCache(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="AsyncCache"):
        AsyncCache(cache)  # type: ignore[arg-type]


def test_every_method_round_trips() -> None:
    async def main() -> None:
        cache = AsyncCache(MemoryCache(1 << 20))
        assert await cache.insert_batch([key(1)], [torch.ones(3)]) == [True]
        assert await cache.batch_is_exist([key(1), key(2)]) == [True, False]
        got = await cache.get_embeddings([key(1), key(2)])
        assert got[1] is None and got[0] is not None and got[0].tolist() == [1.0, 1.0, 1.0]
        assert await cache.prefetch([key(1), key(2)]) == 1
        assert cache.stats().hits == 1
        await cache.close()

    asyncio.run(main())


def test_a_slow_cache_never_blocks_the_event_loop() -> None:
    # the read returns only once the event loop has run other work meanwhile: on a blocked
    # loop it would wait out its 60 s and report that the release never came
    async def main() -> HeldReads:
        slow = HeldReads()
        cache = AsyncCache(slow)

        async def other_work() -> None:
            for _ in range(5):
                await asyncio.sleep(0)
            slow.release.set()

        task = asyncio.create_task(other_work())
        await cache.get_embeddings([key(1)])
        await task
        return slow

    slow = asyncio.run(main())
    assert slow.released is True
    assert slow.thread != threading.main_thread().name


def test_calls_run_in_the_given_executor() -> None:
    async def main(pool: ThreadPoolExecutor) -> str:
        reads = HeldReads()
        reads.release.set()
        await AsyncCache(reads, executor=pool).get_embeddings([key(1)])
        return reads.thread

    with ThreadPoolExecutor(1, thread_name_prefix="mmkey-test-pool") as pool:
        assert asyncio.run(main(pool)).startswith("mmkey-test-pool")


def test_the_caller_may_reuse_its_key_list_while_a_call_runs() -> None:
    async def main() -> list[torch.Tensor | None]:
        inner = HeldReads()
        inner.insert_batch([key(1)], [torch.ones(2)])
        keys: list[CacheKey] = [key(1)]
        task = asyncio.create_task(AsyncCache(inner).get_embeddings(keys))
        await in_thread(lambda: inner.entered.wait(timeout=60))
        keys[0] = key(2)  # while the call runs, before the cache reads its keys
        inner.release.set()
        return await task

    got = asyncio.run(main())
    assert got[0] is not None


def test_argument_errors_surface_from_the_await() -> None:
    async def main() -> None:
        cache = AsyncCache(MemoryCache(1 << 20))
        with pytest.raises(TypeError, match="EmbeddingKey"):
            await cache.get_embeddings([7])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="one embedding per key"):
            await cache.insert_batch([key(1), key(2)], [torch.ones(1)])

    asyncio.run(main())


def test_close_closes_the_wrapped_cache_and_refuses_later_calls() -> None:
    async def main() -> None:
        inner = MemoryCache(1 << 20)
        cache = AsyncCache(inner)
        await cache.close()
        await cache.close()
        with pytest.raises(StoreClosed):
            inner.stats()
        with pytest.raises(StoreClosed):
            await cache.get_embeddings([key(1)])
        with pytest.raises(StoreClosed):
            cache.stats()

    asyncio.run(main())


class HeldInserts(MemoryCache):
    """A real cache whose `insert_batch` waits for `release` before it reads anything."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.entered = threading.Event()
        self.release = threading.Event()

    def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        self.entered.set()
        assert self.release.wait(timeout=60)
        return super().insert_batch(keys, embeddings)


async def in_thread(wait: Callable[[], bool]) -> None:
    assert await asyncio.to_thread(wait)


async def let_the_loop_run(rounds: int = 20) -> None:
    """Yield to the event loop `rounds` times: a task that can go on (a cancellation it
    handles, a call it submits) has gone on by then, with no time passing."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_a_cancelled_insert_returns_once_its_worker_stopped_reading() -> None:
    async def main(pool: ThreadPoolExecutor) -> HeldInserts:
        inner = HeldInserts()
        buffer = torch.full((16,), 1.0)
        cache = AsyncCache(inner, executor=pool)
        task = asyncio.create_task(cache.insert_batch([key(1)], [buffer]))
        await in_thread(lambda: inner.entered.wait(timeout=60))
        task.cancel()
        await let_the_loop_run()
        assert not task.done(), "the worker has not read the buffer yet: the call must wait"
        task.cancel()  # a second cancellation does not cut the wait short either
        await let_the_loop_run()
        assert not task.done()
        inner.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        buffer.fill_(2.0)  # the caller reuses its output buffer at once
        return inner

    with ThreadPoolExecutor(1) as pool:
        inner = asyncio.run(main(pool))
    got = inner.get_embeddings([key(1)])[0]
    assert got is not None and got.tolist() == [1.0] * 16


def test_an_insert_cancelled_before_its_worker_started_never_runs() -> None:
    async def main(pool: ThreadPoolExecutor) -> MemoryCache:
        inner, busy = MemoryCache(1 << 20), threading.Event()
        blocker = pool.submit(busy.wait, 60)  # the only worker is busy
        buffer = torch.full((16,), 1.0)
        cache = AsyncCache(inner, executor=pool)
        task = asyncio.create_task(cache.insert_batch([key(1)], [buffer]))
        await let_the_loop_run()  # the call is queued behind the busy worker
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task  # at once: nothing to wait for
        buffer.fill_(2.0)
        busy.set()
        blocker.result(timeout=60)
        return inner

    with ThreadPoolExecutor(1) as pool:
        inner = asyncio.run(main(pool))
    assert inner.batch_is_exist([key(1)]) == [False]
    assert inner.stats().inserts == 0


def test_an_insert_reads_only_after_waiting_for_the_callers_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mmkey.cache.aio

    log: list[str] = []

    class SpyReady:
        def wait(self) -> None:
            log.append(f"wait on {threading.current_thread().name}")

    def spy_host_ready(tensors: Sequence[object]) -> SpyReady:
        assert [t.tolist() for t in tensors if isinstance(t, torch.Tensor)] == [[3.0, 3.0]]
        log.append(f"ready on {threading.current_thread().name}")
        return SpyReady()

    class Logged(MemoryCache):
        def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
            log.append(f"insert on {threading.current_thread().name}")
            return super().insert_batch(keys, embeddings)

    monkeypatch.setattr(mmkey.cache.aio, "host_ready", spy_host_ready)

    async def main(pool: ThreadPoolExecutor) -> list[bool]:
        cache = AsyncCache(Logged(1 << 20), executor=pool)
        return await cache.insert_batch([key(1)], [torch.full((2,), 3.0)])

    with ThreadPoolExecutor(1, thread_name_prefix="mmkey-insert") as pool:
        assert asyncio.run(main(pool)) == [True]
    loop_thread = threading.current_thread().name
    assert log == [
        f"ready on {loop_thread}",
        "wait on mmkey-insert_0",
        "insert on mmkey-insert_0",
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_output_of_a_side_stream_is_stored_once_written() -> None:  # pragma: no cover
    async def main(cache: AsyncCache) -> list[bool]:
        x = torch.zeros(1 << 20, device="cuda")
        torch.cuda.synchronize()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # ~1 s of cycles
            x.fill_(7.0)
            held = await cache.insert_batch([key(1)], [x])
        torch.cuda.synchronize()
        return held

    inner = MemoryCache(16 << 20)
    assert asyncio.run(main(AsyncCache(inner))) == [True]
    got = inner.get_embeddings([key(1)])[0]
    assert got is not None and torch.equal(got, torch.full((1 << 20,), 7.0))
