"""Caches, the codec and the async adapter: accepted where they should be, strict on keys."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

from mmkey import (
    AsyncCache,
    AsyncEmbeddingCache,
    CacheStats,
    EmbeddingCache,
    EmbeddingKey,
    MemoryCache,
    TieredCache,
    mm_hash,
)
from mmkey.cache._guard import insert_args, key_texts
from mmkey.entry.codec import (
    EntryHeader,
    decode_entry,
    encode_entry,
    encode_entry_into,
    entry_size,
    peek_header,
)


def implementations_are_embedding_caches() -> None:
    memory: EmbeddingCache = MemoryCache(1 << 20)
    tiered: EmbeddingCache = TieredCache(MemoryCache(1 << 20), memory)
    nested: EmbeddingCache = TieredCache(MemoryCache(1 << 10), tiered)
    awaitable: AsyncEmbeddingCache = AsyncCache(nested)
    del awaitable


def a_sync_cache_is_not_an_async_one_nor_the_reverse(cache: MemoryCache) -> None:
    wrong: AsyncEmbeddingCache = cache  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
    also_wrong: EmbeddingCache = AsyncCache(cache)  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
    TieredCache(AsyncCache(cache), cache)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    del wrong, also_wrong


def public_return_types(cache: MemoryCache, tiered: TieredCache, key: EmbeddingKey) -> None:
    t = torch.zeros(2)
    for c in (cache, tiered):
        assert_type(c.batch_is_exist([key]), list[bool])
        assert_type(c.get_embeddings([key]), list[torch.Tensor | None])
        assert_type(c.insert_batch([key], [t]), list[bool])
        assert_type(c.prefetch([key]), int)
        assert_type(c.stats(), CacheStats)
        assert_type(c.close(), None)
    assert_type(cache.max_bytes, int)
    assert_type(tiered.l1, EmbeddingCache)
    assert_type(key_texts([key], "get_embeddings"), list[str])
    assert_type(insert_args([key], [t]), tuple[list[str], list[torch.Tensor]])


def codec_return_types(t: torch.Tensor, buf: bytearray) -> None:
    assert_type(encode_entry("k", t), bytes)
    assert_type(encode_entry_into(buf, "k", t), int)
    assert_type(entry_size("k", t), int)
    assert_type(decode_entry("k", b"entry"), torch.Tensor)
    assert_type(decode_entry("k", memoryview(buf), copy=False), torch.Tensor)
    assert_type(peek_header(buf), EntryHeader)
    assert_type(peek_header(buf).shape, tuple[int, ...])
    assert_type(peek_header(buf).entry_size, int)


async def async_return_types(cache: AsyncCache, key: EmbeddingKey) -> None:
    assert_type(await cache.batch_is_exist([key]), list[bool])
    assert_type(await cache.get_embeddings([key]), list[torch.Tensor | None])
    assert_type(await cache.insert_batch([key], [torch.zeros(1)]), list[bool])
    assert_type(await cache.prefetch([key]), int)
    assert_type(cache.stats(), CacheStats)
    assert_type(cache.cache, EmbeddingCache)


def keys_must_be_cache_keys(cache: MemoryCache, tiered: TieredCache, t: torch.Tensor) -> None:
    digest = mm_hash(7)
    cache.get_embeddings([7])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    cache.get_embeddings([digest])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    cache.get_embeddings(["mmk1@vit@image@blake3@" + "0" * 32])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    cache.batch_is_exist([str(digest)])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    cache.prefetch([b"key"])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    cache.insert_batch([digest], [t])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    tiered.get_embeddings([digest])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    tiered.insert_batch(["k"], [t])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]


async def async_keys_must_be_cache_keys(cache: AsyncCache, t: torch.Tensor) -> None:
    await cache.get_embeddings([mm_hash(7)])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    await cache.insert_batch(["k"], [t])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    await cache.batch_is_exist([1, 2])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]


def embeddings_must_be_tensors(cache: MemoryCache, key: EmbeddingKey) -> None:
    cache.insert_batch([key], [[1.0, 2.0]])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    cache.insert_batch([key], torch.zeros(1, 4))  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def codec_keys_are_key_text(t: torch.Tensor, key: EmbeddingKey) -> None:
    encode_entry(key, t)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    decode_entry(mm_hash(1), b"")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    decode_entry("k", "text is not bytes")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
