"""Items of a multimodal request: grids, per-item feature rows, digests and keys.

A packed feature tensor is laid out like Qwen2-VL's ``pixel_values``: shape
``[sum(t*h*w), ...]``, each item's ``t*h*w`` patch rows contiguous and in ``grid_thw``
order. Audio (or any feature without a shared row layout) comes as a list of tensors,
one per item.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import TypeAlias, overload

import attrs
import torch

from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.hashing import hash_tensor
from mmkey.keys import EmbeddingKey

__all__ = [
    "Features",
    "Grid",
    "GridTHW",
    "embedding_keys",
    "hashes_from_features",
    "keys_from_features",
]

Grid: TypeAlias = tuple[int, int, int]
"""One item's ``(t, h, w)``: frames (temporal patches), patch rows, patch columns."""

GridTHW: TypeAlias = "Sequence[Grid] | torch.Tensor"
"""The grids of a request: ``(t, h, w)`` triples, or an integer tensor of shape ``[N, 3]``."""

Features: TypeAlias = "torch.Tensor | Sequence[torch.Tensor]"
"""A packed ``[rows, ...]`` feature tensor, or one tensor per item (audio)."""


@attrs.frozen(slots=True)
class Items:
    """A request split into items: each item's feature rows, and its grid where known."""

    rows: list[torch.Tensor]
    """Each item's features; views into a packed tensor where there is one."""
    grids: list[Grid] | None
    """Each item's ``(t, h, w)``, or None for a list of tensors given without grids."""
    packed: torch.Tensor | None
    """The packed feature tensor the rows are views of, or None for a list of tensors."""
    grid_tensor: torch.Tensor | None
    """``grid_thw`` as given, when it was a tensor (kept to hand back on its device)."""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of feature data across all items."""
        return sum(r.numel() * r.element_size() for r in self.rows)


def split_items(feature: Features, grid_thw: GridTHW | None) -> Items:
    """Split ``feature`` into items by ``grid_thw``, checking that rows and grids agree.

    Raises `ValueError` naming the item whose rows and grid disagree, and `TypeError`
    for a float grid, a non-tensor item or a packed tensor without grids.
    """
    grid_tensor = grid_thw if isinstance(grid_thw, torch.Tensor) else None
    grids = None if grid_thw is None else _grid_list(grid_thw)
    if isinstance(feature, torch.Tensor):
        if grids is None:
            raise TypeError(
                "a packed feature tensor needs grid_thw to find its items; "
                "pass a list of tensors (one per item) for features without grids"
            )
        return Items(_split_packed(feature, grids), grids, feature, grid_tensor)
    rows = _tensor_list(feature)
    if grids is not None:
        _check_item_rows(rows, grids)
    return Items(rows, grids, None, grid_tensor)


def _grid_list(grid_thw: object) -> list[Grid]:
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.dtype == torch.bool or grid_thw.is_floating_point() or grid_thw.is_complex():
            raise TypeError(
                f"grid_thw must be an integer tensor, got {grid_thw.dtype}; "
                "convert it with grid_thw.long() only if the values are whole numbers"
            )
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must have shape [N, 3], got {list(grid_thw.shape)}")
        entries: list[object] = grid_thw.tolist()
    elif isinstance(grid_thw, Sequence) and not isinstance(grid_thw, (str, bytes)):
        entries = list(grid_thw)
    else:
        raise TypeError(
            f"grid_thw must be a sequence of (t, h, w) triples or an [N, 3] integer tensor, "
            f"got {type(grid_thw).__name__}"
        )
    return [_grid(i, g) for i, g in enumerate(entries)]


def _grid(index: int, entry: object) -> Grid:
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 3:
        raise ValueError(f"item {index}: grid {entry!r} is not a (t, h, w) triple")
    values: list[int] = []
    for v in entry:
        if isinstance(v, bool):
            raise TypeError(f"item {index}: grid {entry!r} holds a bool, not an int")
        try:
            values.append(operator.index(v))
        except TypeError:
            raise TypeError(f"item {index}: grid {entry!r} holds {type(v).__name__}, not an int") from None
    t, h, w = values
    if min(values) < 1:
        raise ValueError(f"item {index}: grid ({t}, {h}, {w}) must have t, h and w >= 1")
    return (t, h, w)


def _split_packed(feature: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
    if feature.dim() == 0:
        raise ValueError("the feature tensor must have a row dimension, got a 0-d tensor")
    rows = feature.shape[0]
    sizes = [t * h * w for t, h, w in grids]
    start = 0
    for i, (grid, size) in enumerate(zip(grids, sizes, strict=True)):
        if start + size > rows:
            raise ValueError(
                f"item {i}: grid {grid} needs rows {start}..{start + size - 1} "
                f"(t*h*w = {size}), but the feature tensor has only {rows} rows; "
                f"grid_thw describes {sum(sizes)} rows in all"
            )
        start += size
    if start != rows:
        last = f"item {len(grids) - 1}'s grid {grids[-1]}" if grids else "grid_thw (empty)"
        raise ValueError(
            f"the feature tensor has {rows} rows but grid_thw describes {start}: rows "
            f"{start}..{rows - 1} belong to no item; is an item missing, or is {last} wrong?"
        )
    # each item's first row; the last offset (the end of the last item) is left unused
    offsets = itertools.accumulate(sizes, initial=0)
    return [feature.narrow(0, start, size) for start, size in zip(offsets, sizes, strict=False)]


def _tensor_list(feature: object) -> list[torch.Tensor]:
    if isinstance(feature, (str, bytes)) or not isinstance(feature, Sequence):
        raise TypeError(
            "feature must be a packed tensor with grid_thw, or a sequence of tensors "
            f"(one per item), got {type(feature).__name__}"
        )
    items = list(feature)
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"item {i}: expected a torch.Tensor, got {type(item).__name__}")
    return items


def _check_item_rows(rows: list[torch.Tensor], grids: list[Grid]) -> None:
    if len(rows) != len(grids):
        raise ValueError(f"{len(rows)} feature tensors but {len(grids)} grids; give one per item")
    for i, (item, grid) in enumerate(zip(rows, grids, strict=True)):
        t, h, w = grid
        have = item.shape[0] if item.dim() else 0
        if have != t * h * w:
            raise ValueError(
                f"item {i}: grid {grid} needs t*h*w = {t * h * w} rows, but its feature tensor has {have}"
            )


def item_digest(rows: torch.Tensor, grid: Grid | None, scheme: HashScheme) -> MMHash:
    """The digest of one item: its rows, framed with its grid where the scheme frames shapes.

    For BLAKE3 and XXH3 the rows are hashed as a zero-copy ``[t, h, w, ...]`` view, so
    the grid is part of the digest (a blank 16x32 image and a blank 32x16 one differ).
    SGLANG hashes the raw bytes only, exactly as SGLang does.
    """
    if grid is not None and scheme is not HashScheme.SGLANG:
        rows = rows.reshape(*grid, *rows.shape[1:])
    return hash_tensor(rows, scheme)


def digests_of(items: Items, scheme: HashScheme) -> list[MMHash]:
    """One digest per item of `items`, in order."""
    grids: Sequence[Grid | None] = items.grids if items.grids is not None else [None] * len(items)
    return [item_digest(rows, grid, scheme) for rows, grid in zip(items.rows, grids, strict=True)]


@overload
def hashes_from_features(
    feature: torch.Tensor, grid_thw: GridTHW, *, scheme: HashScheme = ...
) -> list[MMHash]: ...


@overload
def hashes_from_features(
    feature: Sequence[torch.Tensor], grid_thw: GridTHW | None = ..., *, scheme: HashScheme = ...
) -> list[MMHash]: ...


def hashes_from_features(
    feature: Features,
    grid_thw: GridTHW | None = None,
    *,
    scheme: HashScheme = HashScheme.BLAKE3,
) -> list[MMHash]:
    """One digest per item of a request, in order.

    ``feature`` is a packed ``[sum(t*h*w), ...]`` tensor split by ``grid_thw``, or a list
    of tensors (one per item, e.g. audio), with or without grids. With BLAKE3 and XXH3
    each digest covers the item's dtype, grid, row shape and bytes; with SGLANG it is
    SGLang's CPU hash of the item's bytes. A rows/grid mismatch is a `ValueError`
    naming the item.
    """
    return digests_of(split_items(feature, grid_thw), scheme)


def embedding_keys(
    digests: Sequence[MMHash],
    *,
    namespace: str,
    modality: Modality = Modality.IMAGE,
    scheme: HashScheme = HashScheme.BLAKE3,
) -> list[EmbeddingKey]:
    """The cache key of each digest under ``namespace``; ``scheme`` must be the one that made
    them."""
    return EmbeddingKey.for_digests(namespace, modality, scheme, digests)


@overload
def keys_from_features(
    feature: torch.Tensor,
    grid_thw: GridTHW,
    *,
    namespace: str,
    modality: Modality = ...,
    scheme: HashScheme = ...,
) -> list[EmbeddingKey]: ...


@overload
def keys_from_features(
    feature: Sequence[torch.Tensor],
    grid_thw: GridTHW | None = ...,
    *,
    namespace: str,
    modality: Modality = ...,
    scheme: HashScheme = ...,
) -> list[EmbeddingKey]: ...


def keys_from_features(
    feature: Features,
    grid_thw: GridTHW | None = None,
    *,
    namespace: str,
    modality: Modality = Modality.IMAGE,
    scheme: HashScheme = HashScheme.BLAKE3,
) -> list[EmbeddingKey]:
    """The cache key of each item of a request, as `encode_with_cache` computes them."""
    digests = digests_of(split_items(feature, grid_thw), scheme)
    return embedding_keys(digests, namespace=namespace, modality=modality, scheme=scheme)
