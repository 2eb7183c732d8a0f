"""mmkey.encoder: what a caller may pass and get back, checked by mypy and pyright.

Every negative line carries one ignore comment per checker (see ``typing_tests/__init__.py``):
both checks fail if the error it marks ever goes away.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import assert_type

from mmkey import (
    AsyncCache,
    EmbeddingKey,
    HashScheme,
    MemoryCache,
    MMHash,
    Modality,
)
from mmkey.cli.demo import TinyVisionEncoder
from mmkey.encoder import (
    EncodeReport,
    EncodeResult,
    aencode_with_cache,
    aencode_with_cache_report,
    embedding_keys,
    encode_with_cache,
    encode_with_cache_report,
    hashes_from_features,
    keys_from_features,
)


def vision_tower(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    return [pixel_values]


async def async_tower(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    return [pixel_values]


def audio_tower(clips: Sequence[torch.Tensor], grid_thw: torch.Tensor | None) -> list[torch.Tensor]:
    return list(clips)


def packed_tower(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    return pixel_values


def digests_are_digests_not_key_text(feature: torch.Tensor) -> None:
    digests = hashes_from_features(feature, [(1, 2, 2)])
    assert_type(digests, list[MMHash])
    as_text: list[str] = hashes_from_features(feature, [(1, 2, 2)])  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
    grids = torch.tensor([[1, 2, 2]])
    assert_type(hashes_from_features(feature, grids, scheme=HashScheme.XXH3), list[MMHash])
    assert_type(hashes_from_features([feature, feature]), list[MMHash])
    del as_text


def a_packed_tensor_needs_its_grids(feature: torch.Tensor) -> None:
    hashes_from_features(feature)  # type: ignore[call-overload]  # pyright: ignore[reportArgumentType]
    hashes_from_features(feature, [(1, 2)])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType, reportCallIssue]
    hashes_from_features(feature, "1,2,2")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType, reportCallIssue]


def keys_are_embedding_keys(feature: torch.Tensor, digests: list[MMHash]) -> None:
    keys = keys_from_features(feature, [(1, 2, 2)], namespace="qwen2-vl@1")
    assert_type(keys, list[EmbeddingKey])
    assert_type(embedding_keys(digests, namespace="m", modality=Modality.AUDIO), list[EmbeddingKey])
    embedding_keys([1, 2], namespace="m")  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    embedding_keys(digests, namespace="m", scheme="blake3")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def encode_returns_tensors(feature: torch.Tensor, cache: MemoryCache) -> None:
    out = encode_with_cache(feature, [(1, 2, 2)], encode=vision_tower, cache=cache, namespace="m")
    assert_type(out, list[torch.Tensor])
    result = encode_with_cache_report(
        feature, torch.tensor([[1, 2, 2]]), encode=vision_tower, cache=None, namespace="m"
    )
    assert_type(result, EncodeResult)
    assert_type(result.report, EncodeReport)
    assert_type(result.keys, list[EmbeddingKey])
    model = TinyVisionEncoder()
    encode_with_cache(feature, [(1, 2, 2)], encode=model.encode, cache=cache, namespace="m")
    clips = [feature, feature]
    assert_type(
        encode_with_cache(clips, encode=audio_tower, cache=cache, namespace="m"),
        list[torch.Tensor],
    )
    encode_with_cache(feature, [(1, 2, 2)], encode=vision_tower, cache=cache, namespace="m", device="cuda:0")
    encode_with_cache(clips, encode=audio_tower, cache=cache, namespace="m", device=torch.device("cpu"))


def encode_with_cache_is_strict(feature: torch.Tensor, cache: MemoryCache) -> None:
    # the encoder must return one embedding per item, not one packed tensor
    encode_with_cache(feature, [(1, 2, 2)], encode=packed_tower, cache=cache, namespace="m")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType, reportCallIssue]
    # a dict of digests is not a cache; neither is an async cache on the sync path
    encode_with_cache(feature, [(1, 2, 2)], encode=vision_tower, cache={}, namespace="m")  # type: ignore[call-overload]  # pyright: ignore[reportArgumentType, reportCallIssue]
    encode_with_cache(feature, [(1, 2, 2)], encode=vision_tower, cache=AsyncCache(cache), namespace="m")  # type: ignore[call-overload]  # pyright: ignore[reportArgumentType, reportCallIssue]
    # the namespace is text, the modality and scheme are enum members
    encode_with_cache(feature, [(1, 2, 2)], encode=vision_tower, cache=cache, namespace=7)  # type: ignore[call-overload]  # pyright: ignore[reportArgumentType, reportCallIssue]
    encode_with_cache(feature, [(1, 2, 2)], encode=vision_tower, cache=cache, namespace="m", modality="image")  # type: ignore[call-overload]  # pyright: ignore[reportArgumentType, reportCallIssue]
    # the device is a torch.device or its text, not a bare index
    encode_with_cache(feature, [(1, 2, 2)], encode=vision_tower, cache=cache, namespace="m", device=0)  # type: ignore[call-overload]  # pyright: ignore[reportArgumentType, reportCallIssue]
    # every argument after the grids is keyword-only, and the cache must be named
    encode_with_cache(feature, [(1, 2, 2)], vision_tower, cache, "m")  # type: ignore[call-overload]  # pyright: ignore[reportCallIssue]
    encode_with_cache(feature, [(1, 2, 2)], encode=vision_tower, namespace="m")  # type: ignore[call-overload]  # pyright: ignore[reportCallIssue]


async def the_async_twin(feature: torch.Tensor, cache: MemoryCache) -> None:
    aio = AsyncCache(cache)
    out = await aencode_with_cache(feature, [(1, 2, 2)], encode=async_tower, cache=aio, namespace="m")
    assert_type(out, list[torch.Tensor])
    result = await aencode_with_cache_report(
        feature, [(1, 2, 2)], encode=vision_tower, cache=aio, namespace="m"
    )
    assert_type(result, EncodeResult)
    await aencode_with_cache(feature, [(1, 2, 2)], encode=async_tower, cache=cache, namespace="m")  # type: ignore[call-overload]  # pyright: ignore[reportArgumentType, reportCallIssue]
