"""Key text of a batch: read once per key object, the type checked once per batch when it can be."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmkey import EmbeddingKey, HashScheme, Modality, mm_hash
from mmkey.cache._guard import key_texts
from mmkey.testing.strategies import embedding_keys


def keys(n: int) -> list[EmbeddingKey]:
    return EmbeddingKey.for_digests(
        "texts", Modality.IMAGE, HashScheme.BLAKE3, [mm_hash(i) for i in range(n)]
    )


@attrs.frozen(slots=True)
class Renamed(EmbeddingKey):
    """A subclass with text of its own: its `to_key` must win over the cached text."""

    def to_key(self) -> str:
        return "renamed-" + super().to_key()


class Foreign:
    """A foreign `CacheKey` that happens to carry a `_text` attribute."""

    _text = "not-this"

    def to_key(self) -> str:
        return "foreign-key"


def test_a_batch_of_embedding_keys_gives_their_texts_in_order() -> None:
    batch = keys(50)
    assert key_texts(batch, "m") == [k.to_key() for k in batch]
    assert key_texts(tuple(batch), "m") == [k.to_key() for k in batch]
    assert key_texts([], "m") == []


@given(st.lists(embedding_keys(), max_size=20), st.booleans())
def test_batch_texts_are_each_keys_own_text(batch: list[EmbeddingKey], as_tuple: bool) -> None:
    keys_in: list[EmbeddingKey] | tuple[EmbeddingKey, ...] = tuple(batch) if as_tuple else batch
    assert key_texts(keys_in, "m") == [EmbeddingKey.from_key(k.to_key()).to_key() for k in batch]


def test_keys_of_other_types_in_a_batch_are_checked_one_by_one() -> None:
    batch: list[object] = [
        *keys(3),
        Renamed("texts", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(7)),
        Foreign(),
    ]
    texts = key_texts(batch, "m")  # type: ignore[arg-type]
    assert texts[3].startswith("renamed-mmk1@") and texts[4] == "foreign-key"
    with pytest.raises(TypeError, match="CacheKey"):
        key_texts([*keys(2), 5], "m")  # type: ignore[list-item]
