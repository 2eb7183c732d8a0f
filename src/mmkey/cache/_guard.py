"""Run-time checks of cache arguments, shared by every cache implementation in mmkey.

mypy rejects ints, digests and strings as keys statically; these checks reject them at
run time too, for callers without mypy. Each cache method calls `key_texts` (reads) or
`insert_args` (writes) first and then works on plain key text.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmkey.cache.protocol import EmbeddingCache
from mmkey.keys import CacheKey, EmbeddingKey, embedding_key_texts, key_text

if TYPE_CHECKING:
    import torch

__all__ = ["insert_args", "key_texts", "sync_cache"]


def _as_list(items: object, what: str, method: str) -> list[object]:
    """`items` as a list, refusing text, bytes, tensors, single keys and non-sequences."""
    if isinstance(items, (list, tuple)):
        return list(items)
    name = type(items).__name__
    if isinstance(items, (str, bytes, bytearray, memoryview)):
        fix = "parse key text with EmbeddingKey.from_key(s) and pass [key]"
        raise TypeError(f"{method}() takes a sequence of {what}, got {name}; {fix}")
    if isinstance(items, CacheKey):
        raise TypeError(f"{method}() takes a sequence of {what}, got one {name}; pass [key]")
    if type(items).__module__.startswith("torch"):
        raise TypeError(
            f"{method}() takes a sequence of {what}, got a {name}; "
            "pass a list, e.g. list(t.unbind(0)) for stacked embeddings"
        )
    if not isinstance(items, Sequence):
        raise TypeError(f"{method}() takes a sequence (list or tuple) of {what}, got {name}")
    return list(items)


def key_texts(keys: Sequence[CacheKey], method: str) -> list[str]:
    """The store text of each key, in order, checking every one is a `CacheKey`.

    Raises `TypeError` naming the fix for a str, int, `MMHash` or bytes key (or a bare key
    instead of a sequence), and `InvalidKey` for a foreign ``to_key()`` outside the key
    alphabet. `method` names the caller in messages.
    """
    if type(keys) is list or type(keys) is tuple:
        texts = embedding_key_texts(keys)  # a batch of EmbeddingKey only: one type check
        if texts is not None:
            return texts
    items = _as_list(keys, "CacheKey objects", method)
    # EmbeddingKey checked its text when it was built: skip the generic checks for it
    return [key.to_key() if type(key) is EmbeddingKey else key_text(key) for key in items]


def insert_args(
    keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor], method: str = "insert_batch"
) -> tuple[list[str], list[torch.Tensor]]:
    """Key texts and embeddings of an insert, checked: one `torch.Tensor` per key.

    Raises what `key_texts` raises, `TypeError` for a non-tensor embedding or a stacked
    tensor passed as the sequence, and `ValueError` when the lengths differ.
    """
    import torch

    texts = key_texts(keys, method)
    tensors = _as_list(embeddings, "torch.Tensor embeddings", method)
    if len(tensors) != len(texts):
        raise ValueError(
            f"{method}() got {len(texts)} keys and {len(tensors)} embeddings; "
            "pass exactly one embedding per key"
        )
    if set(map(type, tensors)) <= {torch.Tensor}:  # plain tensors only: one check per batch
        return texts, tensors  # type: ignore[return-value]  # every item is a torch.Tensor
    checked: list[torch.Tensor] = []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{method}() embeddings[{i}] is {type(tensor).__name__}, not torch.Tensor; "
                "convert with torch.as_tensor(x)"
            )
        checked.append(tensor)
    return texts, checked


def sync_cache(cache: object, what: str) -> EmbeddingCache:
    """`cache`, checked to be a synchronous `EmbeddingCache`; `what` names it in messages.

    An `AsyncEmbeddingCache` has the same method names, so the protocol check alone would
    let it through; its coroutine methods are refused here with a `TypeError`.
    """
    if not isinstance(cache, EmbeddingCache):
        raise TypeError(f"{what} must be an EmbeddingCache, got {type(cache).__name__}")
    if inspect.iscoroutinefunction(cache.get_embeddings):
        raise TypeError(
            f"{what} must be a synchronous EmbeddingCache, got the async {type(cache).__name__}; "
            "pass the cache it wraps (AsyncCache(c).cache)"
        )
    return cache
