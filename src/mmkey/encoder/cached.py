"""`encode_with_cache` and its async twin: only cache misses reach the encoder.

Each request is hashed per item, de-duplicated by key, looked up with
``batch_is_exist`` then ``get_embeddings``; the misses (and any entry the cache said it
held but did not return) go to ``encode`` in one call and are inserted; the embeddings
come back one per item, in input order. A failing cache never fails the encode: its
errors are logged, counted in `EncodeReport.cache_errors`, and the items are encoded.

Single-flight, with a cache that supports claims (`ClaimingCache`, e.g. `MooncakeCache`):
the misses are claimed together before encoding; the won ones (and any the cache could not
claim) are encoded in one call, inserted and released; the ones another claimant is encoding
are then waited for (bounded by the cache's ``claim_wait``) and read; what still misses is
encoded in a second call. Won keys are encoded before any wait, so two calls that each won
what the other waits for never wait on each other.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, TypeAlias, TypeVar, overload

import torch

from mmkey._tensors import HostReady, host_ready
from mmkey.cache.protocol import AsyncClaimingCache, AsyncEmbeddingCache, ClaimingCache, EmbeddingCache
from mmkey.digest import HashScheme, Modality
from mmkey.encoder._plan import FAILED, Device, EncodePlan
from mmkey.encoder.items import Features, GridTHW
from mmkey.encoder.report import EncodeResult

__all__ = [
    "AsyncListEncoder",
    "AsyncPackedEncoder",
    "ListEncoder",
    "PackedEncoder",
    "aencode_with_cache",
    "aencode_with_cache_report",
    "encode_with_cache",
    "encode_with_cache_report",
]

PackedEncoder: TypeAlias = Callable[[torch.Tensor, torch.Tensor], Sequence[torch.Tensor]]
"""``encode(pixel_values, grid_thw)`` of the missed items: packed rows and an [M, 3] grid."""

ListEncoder: TypeAlias = Callable[[list[torch.Tensor], "torch.Tensor | None"], Sequence[torch.Tensor]]
"""``encode(features, grid_thw)`` of the missed items: one tensor each, grids if given."""

AsyncPackedEncoder: TypeAlias = Callable[
    [torch.Tensor, torch.Tensor],
    "Sequence[torch.Tensor] | Awaitable[Sequence[torch.Tensor]]",
]
"""A `PackedEncoder` that may be a coroutine function."""

AsyncListEncoder: TypeAlias = Callable[
    [list[torch.Tensor], "torch.Tensor | None"],
    "Sequence[torch.Tensor] | Awaitable[Sequence[torch.Tensor]]",
]
"""A `ListEncoder` that may be a coroutine function."""

_T = TypeVar("_T")

OFFLOAD_HASH_BYTES = 4 << 20
"""The async twin hashes requests of at least this many bytes in a worker thread."""


@overload
def encode_with_cache_report(
    feature: torch.Tensor,
    grid_thw: GridTHW,
    *,
    encode: PackedEncoder,
    cache: EmbeddingCache | None,
    namespace: str,
    modality: Modality = ...,
    scheme: HashScheme = ...,
    device: Device | None = ...,
) -> EncodeResult: ...


@overload
def encode_with_cache_report(
    feature: Sequence[torch.Tensor],
    grid_thw: GridTHW | None = ...,
    *,
    encode: ListEncoder,
    cache: EmbeddingCache | None,
    namespace: str,
    modality: Modality = ...,
    scheme: HashScheme = ...,
    device: Device | None = ...,
) -> EncodeResult: ...


def encode_with_cache_report(
    feature: Features,
    grid_thw: GridTHW | None = None,
    *,
    encode: Callable[[Any, Any], Sequence[torch.Tensor]],
    cache: EmbeddingCache | None,
    namespace: str,
    modality: Modality = Modality.IMAGE,
    scheme: HashScheme = HashScheme.BLAKE3,
    device: Device | None = None,
) -> EncodeResult:
    """`encode_with_cache`, also returning the `EncodeReport` of the call."""
    return _encode(feature, grid_thw, encode, cache, namespace, modality, scheme, device)


def _encode(
    feature: Features,
    grid_thw: GridTHW | None,
    encode: Callable[[Any, Any], Sequence[torch.Tensor]],
    cache: EmbeddingCache | None,
    namespace: str,
    modality: Modality,
    scheme: HashScheme,
    device: Device | None,
) -> EncodeResult:
    plan = EncodePlan.build(
        feature, grid_thw, namespace=namespace, modality=modality, scheme=scheme, device=device
    )
    steps = _steps(plan, cached=cache is not None, claiming=_claims_on(cache, ClaimingCache))
    result: object = None
    try:
        while True:
            operation, args = steps.send(result)
            if operation == "encode":
                result = encode(*args)
            else:
                result = _call(plan, operation, getattr(cache, operation), *args)
    except StopIteration as done:
        finished: EncodeResult = done.value
        return finished
    finally:
        if plan.won and isinstance(cache, ClaimingCache):  # a step raised: never keep a claim
            _call(plan, "release", cache.release, plan.won_keys())


def _claims_on(cache: object, protocol: type[ClaimingCache] | type[AsyncClaimingCache]) -> bool:
    """Whether `cache` supports claims (`protocol`) and has them on (``claim_wait`` > 0)."""
    if cache is None or not isinstance(cache, protocol):
        return False
    try:
        wait: object = cache.claim_wait
    except Exception:  # a cache is an optimisation: no claims, never a failed encode
        return False
    return isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > 0


_Steps: TypeAlias = Generator[tuple[str, tuple[Any, ...]], object, EncodeResult]


def _steps(plan: EncodePlan, *, cached: bool, claiming: bool = False) -> _Steps:
    """The encode path without I/O, shared by the sync and async drivers.

    Yields ``(operation, args)``: a cache method name or ``"encode"``; the driver runs it
    and sends back its result (`FAILED` for a cache call that raised). With `claiming`, the
    misses are claimed first, won keys encoded and released, held ones waited for, and what
    is still missing encoded (see the module). A driver releases `EncodePlan.won` if a step
    raises.
    """
    if not plan.unique_keys:
        return plan.result()
    if cached:
        start = time.perf_counter()
        wanted = plan.take_exists((yield "batch_is_exist", (plan.lookup_keys(),)))
        if wanted:
            plan.take_embeddings((yield "get_embeddings", (wanted,)))
        plan.lookup_seconds += time.perf_counter() - start
    if plan.collect_misses() and claiming:
        start = time.perf_counter()
        plan.take_claims((yield "claim", (plan.miss_keys(),)))
        plan.wait_seconds += time.perf_counter() - start
    yield from _encode_misses(plan, cached=cached)
    if plan.won:
        won, plan.won = plan.won_keys(), []
        yield "release", (won,)
    if plan.held:
        start = time.perf_counter()
        plan.take_waited((yield "wait_for_embeddings", (plan.held_keys(),)))
        plan.wait_seconds += time.perf_counter() - start
        plan.collect_misses()
        yield from _encode_misses(plan, cached=cached)
    return plan.result()


def _encode_misses(plan: EncodePlan, *, cached: bool) -> Generator[tuple[str, tuple[Any, ...]], object, None]:
    """Encode the items `EncodePlan.collect_misses` settled on, and insert them."""
    if not plan.encoding:
        return
    start = time.perf_counter()
    keys, embeddings = plan.take_encoded((yield "encode", plan.encode_inputs()))
    plan.encode_seconds += time.perf_counter() - start
    if cached:
        start = time.perf_counter()
        plan.take_inserted((yield "insert_batch", (keys, embeddings)))
        plan.insert_seconds += time.perf_counter() - start


@overload
def encode_with_cache(
    feature: torch.Tensor,
    grid_thw: GridTHW,
    *,
    encode: PackedEncoder,
    cache: EmbeddingCache | None,
    namespace: str,
    modality: Modality = ...,
    scheme: HashScheme = ...,
    device: Device | None = ...,
) -> list[torch.Tensor]: ...


@overload
def encode_with_cache(
    feature: Sequence[torch.Tensor],
    grid_thw: GridTHW | None = ...,
    *,
    encode: ListEncoder,
    cache: EmbeddingCache | None,
    namespace: str,
    modality: Modality = ...,
    scheme: HashScheme = ...,
    device: Device | None = ...,
) -> list[torch.Tensor]: ...


def encode_with_cache(
    feature: Features,
    grid_thw: GridTHW | None = None,
    *,
    encode: Callable[[Any, Any], Sequence[torch.Tensor]],
    cache: EmbeddingCache | None,
    namespace: str,
    modality: Modality = Modality.IMAGE,
    scheme: HashScheme = HashScheme.BLAKE3,
    device: Device | None = None,
) -> list[torch.Tensor]:
    """One embedding per item of a request, in input order; only misses are encoded.

    ``feature`` is a packed ``[sum(t*h*w), ...]`` tensor with its ``grid_thw``, or a list
    of tensors (one per item, e.g. audio). ``encode`` gets the missed items in the same
    layout and must return one embedding per missed item. Identical items are encoded
    once and share one tensor. ``cache`` None encodes everything (de-duplicated).
    Every embedding comes back on one device: `device` when given; else the device of
    the encoder's first output in this call; else (every item was a cache hit) the
    device of the features. Pass `device` to get the same device on every call.
    A rows/grid mismatch is a `ValueError` naming the item; a bad encoder output is a
    `TypeError`/`ValueError`; cache failures are swallowed and counted (see
    `encode_with_cache_report`).
    """
    return _encode(feature, grid_thw, encode, cache, namespace, modality, scheme, device).embeddings


def _call(plan: EncodePlan, operation: str, method: Callable[..., object], *args: object) -> object:
    try:
        result = method(*args)
    except Exception as exc:  # a cache is an optimisation: never fail the encode
        plan.cache_failed(operation, exc)
        return FAILED
    if inspect.isawaitable(result):  # misuse, not a cache failure: it would lose every hit
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError(
            f"cache.{operation}() returned an awaitable: encode_with_cache takes a "
            "synchronous EmbeddingCache; use aencode_with_cache with an async cache, "
            "or pass the cache it wraps (AsyncCache(c).cache)"
        )
    return result


async def _acall(
    plan: EncodePlan, operation: str, method: Callable[..., Awaitable[object]], *args: object
) -> object:
    try:
        pending: object = method(*args)
    except Exception as exc:  # a cache is an optimisation: never fail the encode
        plan.cache_failed(operation, exc)
        return FAILED
    if not inspect.isawaitable(pending):  # misuse, not a cache failure: it would lose every hit
        raise TypeError(
            f"cache.{operation}() returned {type(pending).__name__}, not an awaitable: "
            "aencode_with_cache takes an AsyncEmbeddingCache; wrap a synchronous cache "
            "with mmkey.AsyncCache(cache), or call encode_with_cache"
        )
    try:
        return await pending
    except Exception as exc:  # a cache is an optimisation: never fail the encode
        plan.cache_failed(operation, exc)
        return FAILED


@overload
async def aencode_with_cache_report(
    feature: torch.Tensor,
    grid_thw: GridTHW,
    *,
    encode: AsyncPackedEncoder,
    cache: AsyncEmbeddingCache | None,
    namespace: str,
    modality: Modality = ...,
    scheme: HashScheme = ...,
    device: Device | None = ...,
) -> EncodeResult: ...


@overload
async def aencode_with_cache_report(
    feature: Sequence[torch.Tensor],
    grid_thw: GridTHW | None = ...,
    *,
    encode: AsyncListEncoder,
    cache: AsyncEmbeddingCache | None,
    namespace: str,
    modality: Modality = ...,
    scheme: HashScheme = ...,
    device: Device | None = ...,
) -> EncodeResult: ...


async def aencode_with_cache_report(
    feature: Features,
    grid_thw: GridTHW | None = None,
    *,
    encode: Callable[[Any, Any], Sequence[torch.Tensor] | Awaitable[Sequence[torch.Tensor]]],
    cache: AsyncEmbeddingCache | None,
    namespace: str,
    modality: Modality = Modality.IMAGE,
    scheme: HashScheme = HashScheme.BLAKE3,
    device: Device | None = None,
) -> EncodeResult:
    """`aencode_with_cache`, also returning the `EncodeReport` of the call."""
    return await _aencode(feature, grid_thw, encode, cache, namespace, modality, scheme, device)


async def _aencode(
    feature: Features,
    grid_thw: GridTHW | None,
    encode: Callable[[Any, Any], Sequence[torch.Tensor] | Awaitable[Sequence[torch.Tensor]]],
    cache: AsyncEmbeddingCache | None,
    namespace: str,
    modality: Modality,
    scheme: HashScheme,
    device: Device | None,
) -> EncodeResult:
    build = functools.partial(
        EncodePlan.build,
        feature,
        grid_thw,
        namespace=namespace,
        modality=modality,
        scheme=scheme,
        device=device,
    )
    if _nbytes(feature) >= OFFLOAD_HASH_BYTES:
        # the worker thread has its own current CUDA streams: it reads the features only
        # once the caller's streams have finished writing them
        ready = host_ready(_tensors_of(feature, grid_thw))
        plan = await asyncio.to_thread(_when_ready, ready, build)
    else:
        plan = build()
    steps = _steps(plan, cached=cache is not None, claiming=_claims_on(cache, AsyncClaimingCache))
    result: object = None
    try:
        while True:
            operation, args = steps.send(result)
            if operation == "encode":
                result = encode(*args)
                if inspect.isawaitable(result):
                    result = await result
            else:
                result = await _acall(plan, operation, getattr(cache, operation), *args)
    except StopIteration as done:
        finished: EncodeResult = done.value
        return finished
    finally:
        if plan.won and isinstance(cache, AsyncClaimingCache):  # a step raised: never keep a claim
            await _acall(plan, "release", cache.release, plan.won_keys())


@overload
async def aencode_with_cache(
    feature: torch.Tensor,
    grid_thw: GridTHW,
    *,
    encode: AsyncPackedEncoder,
    cache: AsyncEmbeddingCache | None,
    namespace: str,
    modality: Modality = ...,
    scheme: HashScheme = ...,
    device: Device | None = ...,
) -> list[torch.Tensor]: ...


@overload
async def aencode_with_cache(
    feature: Sequence[torch.Tensor],
    grid_thw: GridTHW | None = ...,
    *,
    encode: AsyncListEncoder,
    cache: AsyncEmbeddingCache | None,
    namespace: str,
    modality: Modality = ...,
    scheme: HashScheme = ...,
    device: Device | None = ...,
) -> list[torch.Tensor]: ...


async def aencode_with_cache(
    feature: Features,
    grid_thw: GridTHW | None = None,
    *,
    encode: Callable[[Any, Any], Sequence[torch.Tensor] | Awaitable[Sequence[torch.Tensor]]],
    cache: AsyncEmbeddingCache | None,
    namespace: str,
    modality: Modality = Modality.IMAGE,
    scheme: HashScheme = HashScheme.BLAKE3,
    device: Device | None = None,
) -> list[torch.Tensor]:
    """The asyncio twin of `encode_with_cache`, over an `AsyncEmbeddingCache`.

    ``encode`` may be a coroutine function or a plain one (a plain one runs on the event
    loop: wrap a slow model in ``asyncio.to_thread``). Requests of at least
    `~mmkey.encoder.cached.OFFLOAD_HASH_BYTES` are hashed in a worker thread.
    """
    result = await _aencode(feature, grid_thw, encode, cache, namespace, modality, scheme, device)
    return result.embeddings


def _when_ready(ready: HostReady, call: Callable[[], _T]) -> _T:
    ready.wait()
    return call()


def _tensors_of(feature: object, grid_thw: object) -> list[object]:
    """The tensors of a request that hashing reads: features and a grid tensor."""
    tensors: list[object] = [grid_thw]
    if isinstance(feature, (list, tuple)):
        tensors.extend(feature)
    else:
        tensors.append(feature)
    return tensors


def _nbytes(feature: object) -> int:
    """Feature bytes of a request; 0 for malformed input, which `EncodePlan.build` refuses."""
    if isinstance(feature, torch.Tensor):
        return feature.numel() * feature.element_size()
    if isinstance(feature, (str, bytes)) or not isinstance(feature, Sequence):
        return 0
    return sum(t.numel() * t.element_size() for t in feature if isinstance(t, torch.Tensor))
