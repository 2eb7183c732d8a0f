"""The SGLang store's batched lookup fast path gives exactly what the per-hash path gives."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

pytest.importorskip("sglang")

from mmkey import EmbeddingKey, HashScheme, Modality, mm_hash  # noqa: E402
from mmkey.integrations.sglang._store import _bounded_set, _one_text_each  # noqa: E402

KEY_TEXTS = [
    EmbeddingKey("m", modality, HashScheme.SGLANG, mm_hash(i)).to_key() for i, modality in enumerate(Modality)
]
TEXTS = ["1", "2", "3", "x"]


Memo = dict[str, str | tuple[str, ...]]
"""Hash text -> the key text a lookup asks, or a tuple of them (one per pool)."""


def per_hash(lookups: Memo, hashes: list[str]) -> list[str] | None:
    found: list[str] = []
    for text in hashes:
        remembered = lookups.get(text)
        if not isinstance(remembered, str):
            return None
        found.append(remembered)
    return found


@given(
    st.dictionaries(
        st.sampled_from(TEXTS),
        st.sampled_from(KEY_TEXTS) | st.lists(st.sampled_from(KEY_TEXTS), max_size=3).map(tuple),
    ),
    st.lists(st.sampled_from(TEXTS), max_size=8),
)
@example({"1": KEY_TEXTS[0]}, ["1", "1"])
@example({"1": KEY_TEXTS[0]}, ["1", "2"])
@example({"1": (KEY_TEXTS[0],)}, ["1"])  # a tuple, even of one, goes hash by hash
@example({"1": (KEY_TEXTS[0], KEY_TEXTS[1])}, ["1"])
@example({}, [])
def test_one_text_each_matches_the_per_hash_reference(lookups: Memo, hashes: list[str]) -> None:
    assert _one_text_each(lookups, hashes) == per_hash(lookups, hashes)


def test_one_text_each_leaves_unhashable_items_to_the_per_hash_path() -> None:
    assert _one_text_each({"1": KEY_TEXTS[0]}, ["1", ["2"]]) is None  # type: ignore[list-item]


def test_bounded_set_keeps_at_most_the_limit_dropping_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's memos stay bounded: a new text drops the oldest, a remembered one drops none."""
    import mmkey.integrations.sglang._store as store_module

    monkeypatch.setattr(store_module, "_KNOWN_HASHES", 3)
    memo: dict[str, str] = {}
    for text in "abcd":
        _bounded_set(memo, text, text.upper())
    assert memo == {"b": "B", "c": "C", "d": "D"}
    _bounded_set(memo, "c", "C2")
    assert memo == {"b": "B", "c": "C2", "d": "D"}
