"""AsyncCache: the same cache, awaited from asyncio without ever blocking the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
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


class SlowCache(MemoryCache):
    """A MemoryCache whose reads take 0.2 s, like a store behind a slow network."""

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        self.thread = threading.current_thread().name
        time.sleep(0.2)
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
    async def main() -> int:
        slow = SlowCache(1 << 20)
        cache = AsyncCache(slow)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await cache.get_embeddings([key(1)])
        task.cancel()
        assert slow.thread != threading.main_thread().name
        return ticks

    assert asyncio.run(main()) >= 5


def test_calls_run_in_the_given_executor() -> None:
    async def main(pool: ThreadPoolExecutor) -> str:
        slow = SlowCache(1 << 20)
        await AsyncCache(slow, executor=pool).get_embeddings([key(1)])
        return slow.thread

    with ThreadPoolExecutor(1, thread_name_prefix="mmkey-test-pool") as pool:
        assert asyncio.run(main(pool)).startswith("mmkey-test-pool")


def test_the_caller_may_reuse_its_key_list_while_a_call_runs() -> None:
    async def main() -> list[torch.Tensor | None]:
        inner = SlowCache(1 << 20)
        inner.insert_batch([key(1)], [torch.ones(2)])
        keys: list[CacheKey] = [key(1)]
        task = asyncio.create_task(AsyncCache(inner).get_embeddings(keys))
        await asyncio.sleep(0.05)
        keys[0] = key(2)
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
