"""Public hypothesis strategies for mmkey's types, for downstream property tests.

Importing this module (or just having mmkey installed, through hypothesis' entry point)
registers them, so ``st.from_type(MMHash)`` and ``st.from_type(EmbeddingKey)`` give valid
values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hypothesis import strategies as st

from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.keys import MAX_NAMESPACE_CHARS, EmbeddingKey

if TYPE_CHECKING:
    import torch

__all__ = [
    "HOSTILE_NAMESPACES",
    "digests",
    "embedding_keys",
    "feature_tensors",
    "key_texts",
    "modalities",
    "namespaces",
    "register_type_strategies",
    "schemes",
]

HOSTILE_NAMESPACES: tuple[str, ...] = (
    "@",
    "model@rev",
    "%",
    "%41",
    "%2f",
    'a/b\\c:d*e?f"g<h>i|j',
    " ",
    "tab\there",
    "line\n",
    "+1",
    "1_000",
    "\u0661\u0662",
    "Ä",
    "\U0001f642",
    "\x00",
    "mmk1@ns@image@blake3@00",
    "~-._",
    "x" * MAX_NAMESPACE_CHARS,
)
"""Namespaces that broke key parsers elsewhere: separators, escapes, digits, odd bytes."""


def schemes() -> st.SearchStrategy[HashScheme]:
    """Any hash scheme."""
    return st.sampled_from(HashScheme)


def modalities() -> st.SearchStrategy[Modality]:
    """Any modality."""
    return st.sampled_from(Modality)


def digests(scheme: HashScheme | None = None) -> st.SearchStrategy[MMHash]:
    """Valid digests for ``scheme`` (128-bit when None), edges included."""
    return _digests(128 if scheme is None else scheme.bits)


# Built once: `embedding_keys` draws from these on every example, and a strategy built anew
# each time is validated anew (the namespace regex compiled again): that was most of the cost
# of an example.
@functools.cache
def _digests(bits: int) -> st.SearchStrategy[MMHash]:
    top = (1 << bits) - 1
    return st.one_of(
        st.sampled_from([0, 1, top, 1 << (bits - 1), top >> 4]),
        st.integers(min_value=0, max_value=top),
    ).map(MMHash)


def namespaces() -> st.SearchStrategy[str]:
    """Valid namespaces: any Unicode text of 1 to 256 characters, hostile cases favoured."""
    return _namespaces()


@functools.cache
def _namespaces() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(HOSTILE_NAMESPACES),
        st.text(st.characters(codec="utf-8"), min_size=1, max_size=MAX_NAMESPACE_CHARS),
        st.from_regex(r"[a-z0-9][a-z0-9._@/-]{0,40}", fullmatch=True),
    )


@st.composite
def embedding_keys(
    draw: st.DrawFn,
    namespace: st.SearchStrategy[str] | None = None,
    modality: st.SearchStrategy[Modality] | None = None,
    scheme: st.SearchStrategy[HashScheme] | None = None,
) -> EmbeddingKey:
    """Valid `EmbeddingKey` values; each part drawn from the given strategy or any."""
    chosen = draw(scheme if scheme is not None else schemes())
    return EmbeddingKey(
        draw(namespace if namespace is not None else namespaces()),
        draw(modality if modality is not None else modalities()),
        chosen,
        draw(digests(chosen)),
    )


def key_texts() -> st.SearchStrategy[str]:
    """Valid key format v1 text."""
    return embedding_keys().map(EmbeddingKey.to_key)


_DTYPE_NAMES = (
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "bool",
)


@st.composite
def feature_tensors(
    draw: st.DrawFn,
    dtypes: Sequence[str] = _DTYPE_NAMES,
    max_dims: int = 3,
    max_side: int = 8,
) -> torch.Tensor:
    """Small CPU tensors of any listed dtype and shape (0-d and empty included),
    sometimes non-contiguous views."""
    import torch

    dtype = getattr(torch, draw(st.sampled_from(dtypes)))
    shape = draw(st.lists(st.integers(0, max_side), max_size=max_dims))
    seed = draw(st.integers(0, 2**32 - 1))
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=gen) * 100).to(dtype)
    else:
        info = torch.iinfo(dtype)
        low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
        t = torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    return t


def register_type_strategies() -> None:
    """Make ``st.from_type`` yield valid `MMHash` digests and `EmbeddingKey` values."""
    st.register_type_strategy(MMHash, digests())
    st.register_type_strategy(EmbeddingKey, embedding_keys())


register_type_strategies()
