"""aencode_with_cache: the asyncio twin of encode_with_cache, over AsyncEmbeddingCache."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import mmkey.encoder.cached
from mmkey import AsyncCache, CacheKey, CacheStats, MemoryCache
from mmkey.encoder import aencode_with_cache, aencode_with_cache_report, encode_with_cache
from mmkey.encoder._plan import EncodePlan
from tests.encoder.test_encoder import NS, CountingEncoder, DictCache, item, reference, request


class AsyncDictCache:
    """The test DictCache behind coroutine methods (faults included)."""

    def __init__(self) -> None:
        self.inner = DictCache()

    async def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        await asyncio.sleep(0)
        return self.inner.batch_is_exist(keys)

    async def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        await asyncio.sleep(0)
        return self.inner.get_embeddings(keys)

    async def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        await asyncio.sleep(0)
        return self.inner.insert_batch(keys, embeddings)

    async def prefetch(self, keys: Sequence[CacheKey]) -> int:
        return 0

    def stats(self) -> CacheStats:
        return self.inner.stats()

    async def close(self) -> None:
        pass


class AsyncCountingEncoder(CountingEncoder):
    """A CountingEncoder awaited like a model run in a worker thread."""

    async def run(self, features: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        return await asyncio.to_thread(self, features, grid_thw)


def test_only_misses_reach_an_async_encoder_once_each_in_order() -> None:
    async def main() -> None:
        cache, encode = AsyncDictCache(), AsyncCountingEncoder()
        await aencode_with_cache(*request([1, 2]), encode=encode.run, cache=cache, namespace=NS)
        ids = [3, 1, 3, 2, 4]
        result = await aencode_with_cache_report(*request(ids), encode=encode.run, cache=cache, namespace=NS)
        assert encode.items_encoded == 4, "3 and 4 once each; 1 and 2 were hits"
        assert all(torch.equal(g, reference(*item(i))) for g, i in zip(result.embeddings, ids, strict=True))
        assert (result.report.hits, result.report.encoded, result.report.duplicates) == (2, 2, 1)

    asyncio.run(main())


def test_a_plain_encoder_function_is_accepted() -> None:
    async def main() -> None:
        encode = CountingEncoder()
        out = await aencode_with_cache(*request([5, 5]), encode=encode, cache=AsyncDictCache(), namespace=NS)
        assert encode.items_encoded == 1 and out[0] is out[1]

    asyncio.run(main())


def test_sync_and_async_twins_share_keys_and_results() -> None:
    memory = MemoryCache(1 << 20)
    sync_out = encode_with_cache(*request([1, 2]), encode=CountingEncoder(), cache=memory, namespace=NS)

    async def main() -> None:
        encode = CountingEncoder()
        result = await aencode_with_cache_report(
            *request([2, 1]), encode=encode, cache=AsyncCache(memory), namespace=NS
        )
        assert encode.calls == [] and result.report.hits == 2
        assert torch.equal(result.embeddings[0], sync_out[1])
        assert torch.equal(result.embeddings[1], sync_out[0])

    asyncio.run(main())


@pytest.mark.parametrize("op", ["batch_is_exist", "get_embeddings", "insert_batch"])
def test_a_failing_async_cache_recomputes_and_counts(op: str) -> None:
    async def main() -> None:
        cache, encode = AsyncDictCache(), CountingEncoder()
        await aencode_with_cache(*request([1]), encode=encode, cache=cache, namespace=NS)
        cache.inner.fail.add(op)
        result = await aencode_with_cache_report(*request([1, 2]), encode=encode, cache=cache, namespace=NS)
        assert all(
            torch.equal(g, reference(*item(i))) for g, i in zip(result.embeddings, [1, 2], strict=True)
        )
        assert result.report.cache_errors == 1

    asyncio.run(main())


def test_a_stale_entry_is_encoded_by_the_async_twin() -> None:
    async def main() -> None:
        cache, encode = AsyncDictCache(), CountingEncoder()
        first = await aencode_with_cache(*request([1]), encode=encode, cache=cache, namespace=NS)
        cache.inner.forget_on_get.update(cache.inner.entries)
        result = await aencode_with_cache_report(*request([1]), encode=encode, cache=cache, namespace=NS)
        assert (result.report.stale, result.report.encoded) == (1, 1)
        assert torch.equal(result.embeddings[0], first[0])

    asyncio.run(main())


def test_large_requests_are_hashed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    hashing_threads: set[int] = set()
    real = EncodePlan.build

    def spy(*args: Any, **kwargs: Any) -> EncodePlan:
        hashing_threads.add(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(EncodePlan, "build", spy)
    monkeypatch.setattr(mmkey.encoder.cached, "OFFLOAD_HASH_BYTES", 1)

    async def main() -> int:
        out = await aencode_with_cache(
            *request([1, 2]), encode=CountingEncoder(), cache=AsyncDictCache(), namespace=NS
        )
        assert all(torch.equal(g, reference(*item(i))) for g, i in zip(out, [1, 2], strict=True))
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert hashing_threads and loop_thread not in hashing_threads


def test_concurrent_requests_each_get_their_own_embeddings() -> None:
    async def main() -> None:
        cache = AsyncCache(MemoryCache(1 << 20))
        encode = AsyncCountingEncoder()
        batches = [[1, 2], [2, 3], [3, 1, 1], [4], [1, 4, 2]]
        results = await asyncio.gather(
            *(
                aencode_with_cache(*request(ids), encode=encode.run, cache=cache, namespace=NS)
                for ids in batches
            )
        )
        for ids, out in zip(batches, results, strict=True):
            assert all(torch.equal(g, reference(*item(i))) for g, i in zip(out, ids, strict=True))
        await cache.close()

    asyncio.run(main())


def test_a_synchronous_cache_is_refused_by_the_async_twin_not_silently_missed() -> None:
    # a sync cache's results cannot be awaited: swallowing that would lose every hit
    async def main() -> None:
        cache = MemoryCache(1 << 20)
        with pytest.raises(TypeError, match="AsyncCache"):
            await aencode_with_cache(  # type: ignore[call-overload]
                *request([1]), encode=CountingEncoder(), cache=cache, namespace=NS
            )

    asyncio.run(main())


def test_an_async_cache_is_refused_by_the_sync_path_not_silently_missed() -> None:
    cache = AsyncCache(MemoryCache(1 << 20))
    with pytest.raises(TypeError, match="synchronous EmbeddingCache"):
        encode_with_cache(  # type: ignore[call-overload]
            *request([1]), encode=CountingEncoder(), cache=cache, namespace=NS
        )


@pytest.mark.parametrize("feature", [["a", "b"], "ab", 3])
def test_malformed_features_are_a_type_error_in_the_async_twin(feature: Any) -> None:
    encode: Any = CountingEncoder()

    async def main() -> None:
        with pytest.raises(TypeError):
            await aencode_with_cache(feature, encode=encode, cache=None, namespace=NS)

    asyncio.run(main())


def test_the_async_twin_returns_one_device_too() -> None:
    from tests.encoder.test_encoder import DeviceEncoder, cache_holding, devices

    async def main() -> None:
        cache = AsyncCache(cache_holding([1]))
        out = await aencode_with_cache(
            *request([1, 2]), encode=DeviceEncoder("meta"), cache=cache, namespace=NS
        )
        assert devices(out) == {"meta"}
        pinned = await aencode_with_cache_report(
            *request([1, 3]), encode=CountingEncoder(), cache=cache, namespace=NS, device="meta"
        )
        assert devices(pinned.embeddings) == {"meta"} and pinned.report.hits == 1

    asyncio.run(main())


def test_offloaded_hashing_waits_for_the_callers_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    real = EncodePlan.build

    class SpyReady:
        def wait(self) -> None:
            log.append(f"wait on {threading.current_thread().name}")

    def spy_host_ready(tensors: Sequence[object]) -> SpyReady:
        log.append(f"ready on {threading.current_thread().name} for {len(tensors)}")
        return SpyReady()

    def spy_build(*args: Any, **kwargs: Any) -> EncodePlan:
        log.append(f"hash on {threading.current_thread().name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(mmkey.encoder.cached, "host_ready", spy_host_ready)
    monkeypatch.setattr(mmkey.encoder.cached, "OFFLOAD_HASH_BYTES", 1)
    monkeypatch.setattr(EncodePlan, "build", spy_build)

    async def main() -> None:
        feature, grids = request([1, 2])
        clips = [item(1)[0], item(2)[0]]
        await aencode_with_cache(
            feature, torch.tensor(grids), encode=CountingEncoder(), cache=None, namespace=NS
        )
        out = await aencode_with_cache(
            clips, encode=lambda feats, _: [f.sum(0) for f in feats], cache=None, namespace=NS
        )
        assert torch.equal(out[1], clips[1].sum(0))

    asyncio.run(main())
    loop = threading.current_thread().name
    assert [entry.split(" on ")[0] for entry in log] == ["ready", "wait", "hash"] * 2
    assert log[0] == f"ready on {loop} for 2" and log[3] == f"ready on {loop} for 3"
    assert all(loop not in entry for entry in log if not entry.startswith("ready"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_features_written_on_a_side_stream_hash_as_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # pragma: no cover
    from mmkey.encoder import hashes_from_features

    monkeypatch.setattr(mmkey.encoder.cached, "OFFLOAD_HASH_BYTES", 1)
    cpu_feature, grids = request([1, 2])

    def encode(features: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        return [torch.zeros(1, device=features.device) for _ in range(grid_thw.shape[0])]

    async def main() -> list[torch.Tensor]:
        source = cpu_feature.cuda()
        feature = torch.zeros_like(source)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # ~1 s of cycles
            feature.copy_(source)  # device to device: queued behind the sleep
            result = await aencode_with_cache_report(feature, grids, encode=encode, cache=None, namespace=NS)
        torch.cuda.synchronize()
        assert [k.digest for k in result.keys] == hashes_from_features(cpu_feature, grids)
        return result.embeddings

    asyncio.run(main())
