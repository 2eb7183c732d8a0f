"""Digests, schemes and keys: the seed bug and its cousins are type errors for mypy and pyright."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import assert_type

from mmkey import (
    CacheKey,
    EmbeddingCache,
    EmbeddingKey,
    HashScheme,
    MMHash,
    Modality,
    hash_bytes,
    hash_tensor,
    mm_hash,
)
from mmkey.keys import key_text


def public_return_types(t: torch.Tensor, key: EmbeddingKey) -> None:
    assert_type(mm_hash(1), MMHash)
    assert_type(mm_hash(1, HashScheme.SGLANG), MMHash)
    assert_type(hash_tensor(t), MMHash)
    assert_type(hash_tensor(t, HashScheme.XXH3), MMHash)
    assert_type(hash_bytes(b"x"), MMHash)
    assert_type(hash_bytes(bytearray(b"x"), HashScheme.SGLANG), MMHash)
    assert_type(key.to_key(), str)
    assert_type(EmbeddingKey.from_key("k"), EmbeddingKey)
    assert_type(key.digest, MMHash)
    assert_type(key.namespace, str)
    assert_type(key.modality, Modality)
    assert_type(key.scheme, HashScheme)
    assert_type(HashScheme.BLAKE3.bits, int)
    assert_type(HashScheme.BLAKE3.hex_width, int)
    assert_type(key_text(key), str)


def keys_are_cache_keys(key: EmbeddingKey) -> None:
    as_protocol: CacheKey = key
    batch: Sequence[CacheKey] = [key]
    del as_protocol, batch


def the_seed_bug(cache: EmbeddingCache, t: torch.Tensor) -> None:
    hashes = [hash_tensor(t)]
    # digests handed to a cache keyed by CacheKey
    cache.batch_is_exist(hashes)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    # the one-line "fix" of the original bug: strings are not keys either
    cache.batch_is_exist([str(h) for h in hashes])  # type: ignore[misc]  # pyright: ignore[reportArgumentType]
    cache.get_embeddings(hashes)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    cache.insert_batch([str(hashes[0])], [t])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    # a single key string passed as the whole batch
    cache.batch_is_exist("mmk1@ns@image@blake3@00")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def digests_are_not_plain_ints_or_text(h: MMHash, n: int) -> None:
    EmbeddingKey("ns", Modality.IMAGE, HashScheme.BLAKE3, n)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    EmbeddingKey("ns", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(n))
    text: str = h  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
    h.upper()  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType]
    "emb_" + h  # type: ignore[operator]  # pyright: ignore[reportOperatorIssue, reportUnusedExpression]
    del text


def parts_have_their_own_types(h: MMHash) -> None:
    EmbeddingKey("ns", "image", HashScheme.BLAKE3, h)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    EmbeddingKey("ns", Modality.IMAGE, "blake3", h)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    EmbeddingKey(b"ns", Modality.IMAGE, HashScheme.BLAKE3, h)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    EmbeddingKey.from_key(b"mmk1")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    hash_tensor([1.0, 2.0])  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    hash_bytes("text")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    hash_tensor(torch.zeros(1), "blake3")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    mm_hash("5")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def keys_are_immutable(key: EmbeddingKey) -> None:
    key.digest = mm_hash(1)  # type: ignore[misc]  # pyright: ignore[reportAttributeAccessIssue]
