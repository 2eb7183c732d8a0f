"""Run-time guards: every cache method refuses what mypy would, with a message naming the fix."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mmkey import (
    AsyncCache,
    EmbeddingKey,
    HashScheme,
    InvalidKey,
    MemoryCache,
    Modality,
    TieredCache,
    mm_hash,
)
from mmkey.cache._guard import insert_args, key_texts

KEY = EmbeddingKey("vit", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(5))


class ForeignKey:
    """A `CacheKey` from another library whose text breaks the key alphabet."""

    def __init__(self, text: object) -> None:
        self.text = text

    def to_key(self) -> str:
        return self.text  # type: ignore[return-value]


class SyncOfAsync:
    """Drives an `AsyncCache` from synchronous test code."""

    def __init__(self, cache: AsyncCache) -> None:
        self.cache = cache

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.cache, name)
        return lambda *args: asyncio.run(method(*args))


def memory() -> Any:
    return MemoryCache(1 << 20)


def tiered() -> Any:
    return TieredCache(MemoryCache(1 << 20), MemoryCache(1 << 20))


def async_memory() -> Any:
    return SyncOfAsync(AsyncCache(MemoryCache(1 << 20)))


CACHES = pytest.mark.parametrize("make", [memory, tiered, async_memory], ids=["memory", "tiered", "async"])
READS = pytest.mark.parametrize("method", ["batch_is_exist", "get_embeddings", "prefetch"])

WRONG_KEYS = [
    (12345, TypeError, "wrap it: EmbeddingKey"),
    (mm_hash(12345), TypeError, "wrap it: EmbeddingKey"),
    (KEY.to_key(), TypeError, "EmbeddingKey.from_key"),
    ("12345", TypeError, "EmbeddingKey.from_key"),
    (b"mmk1", TypeError, "CacheKey objects"),
    (None, TypeError, "CacheKey objects"),
    (ForeignKey("has space"), InvalidKey, "key alphabet"),
    (ForeignKey("a/b"), InvalidKey, "key alphabet"),
    (ForeignKey(""), InvalidKey, "key alphabet"),
    (ForeignKey(42), InvalidKey, "not str"),
]


@CACHES
@READS
@pytest.mark.parametrize(("bad", "error", "message"), WRONG_KEYS)
def test_reads_refuse_keys_that_are_not_cache_keys(
    make: Callable[[], Any], method: str, bad: object, error: type[Exception], message: str
) -> None:
    cache = make()
    with pytest.raises(error, match=message):
        getattr(cache, method)([KEY, bad])


@CACHES
@pytest.mark.parametrize(("bad", "error", "message"), WRONG_KEYS)
def test_inserts_refuse_them_and_store_nothing(
    make: Callable[[], Any], bad: object, error: type[Exception], message: str
) -> None:
    cache = make()
    with pytest.raises(error, match=message):
        cache.insert_batch([KEY, bad], [torch.ones(1), torch.ones(1)])
    assert cache.batch_is_exist([KEY]) == [False]


@CACHES
@READS
@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (KEY.to_key(), "EmbeddingKey.from_key"),
        (KEY, r"pass \[key\]"),
        (torch.tensor([1, 2]), "pass a list"),
        ({KEY}, "list or tuple"),
        (12345, "list or tuple"),
    ],
    ids=["key-text", "bare-key", "tensor", "set", "int"],
)
def test_the_key_sequence_itself_is_checked(
    make: Callable[[], Any], method: str, keys: object, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        getattr(make(), method)(keys)


@CACHES
def test_inserts_need_one_tensor_per_key(make: Callable[[], Any]) -> None:
    cache = make()
    with pytest.raises(ValueError, match="2 keys and 1 embeddings"):
        cache.insert_batch([KEY, KEY], [torch.ones(1)])
    with pytest.raises(ValueError, match="1 keys and 2 embeddings"):
        cache.insert_batch([KEY], [torch.ones(1), torch.ones(1)])
    with pytest.raises(TypeError, match=r"embeddings\[0\] is list"):
        cache.insert_batch([KEY], [[1.0]])
    with pytest.raises(TypeError, match="unbind"):
        cache.insert_batch([KEY], torch.ones(1, 4))
    assert cache.batch_is_exist([KEY]) == [False]


def test_tuples_and_empty_batches_are_fine() -> None:
    assert key_texts((KEY,), "get_embeddings") == [KEY.to_key()]
    assert key_texts([], "get_embeddings") == []
    assert insert_args((KEY,), (torch.ones(1),))[0] == [KEY.to_key()]


def test_a_foreign_cache_key_in_the_alphabet_is_accepted() -> None:
    cache = MemoryCache(1 << 20)
    foreign = ForeignKey("my-lib@v2@abc%20def")
    assert cache.insert_batch([foreign], [torch.ones(2)]) == [True]
    got = cache.get_embeddings([foreign])[0]
    assert got is not None and got.tolist() == [1.0, 1.0]


def test_messages_name_the_calling_method() -> None:
    with pytest.raises(TypeError, match=r"^prefetch\(\) takes a sequence"):
        MemoryCache(1).prefetch(KEY)  # type: ignore[arg-type]
