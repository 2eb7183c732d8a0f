"""The SGLang store's batched lookup fast path gives exactly what the per-hash path gives."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

pytest.importorskip("sglang")

from mmkey import EmbeddingKey, HashScheme, Modality, mm_hash  # noqa: E402
from mmkey.integrations.sglang._store import _one_key_each  # noqa: E402

KEYS = [EmbeddingKey("m", modality, HashScheme.SGLANG, mm_hash(i)) for i, modality in enumerate(Modality)]
TEXTS = ["1", "2", "3", "x"]


def per_hash(lookups: dict[str, tuple[EmbeddingKey, ...]], hashes: list[str]) -> list[EmbeddingKey] | None:
    found: list[EmbeddingKey] = []
    for text in hashes:
        group = lookups.get(text)
        if group is None or len(group) != 1:
            return None
        found.append(group[0])
    return found


@given(
    st.dictionaries(st.sampled_from(TEXTS), st.lists(st.sampled_from(KEYS), max_size=3).map(tuple)),
    st.lists(st.sampled_from(TEXTS), max_size=8),
)
@example({"1": (KEYS[0],)}, ["1", "1"])
@example({"1": (KEYS[0], KEYS[1])}, ["1"])
@example({"1": (KEYS[0],)}, ["1", "2"])
@example({}, [])
def test_one_key_each_matches_the_per_hash_reference(
    lookups: dict[str, tuple[EmbeddingKey, ...]], hashes: list[str]
) -> None:
    assert _one_key_each(lookups, hashes) == per_hash(lookups, hashes)


def test_one_key_each_leaves_unhashable_items_to_the_per_hash_path() -> None:
    assert _one_key_each({"1": (KEYS[0],)}, ["1", ["2"]]) is None  # type: ignore[list-item]
