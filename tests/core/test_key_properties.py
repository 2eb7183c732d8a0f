"""Hypothesis proofs of key format v1: round trips both ways, injectivity, the alphabet."""

from __future__ import annotations

import re

from hypothesis import example, given, settings
from hypothesis import strategies as st

from mmkey import EmbeddingKey, HashScheme, InvalidKey, Modality, mm_hash
from mmkey.testing.strategies import embedding_keys, key_texts

ALPHABET = re.compile(r"[A-Za-z0-9._~%@-]+")
# 10 times the profile's examples: 1000 under `ci`, whose derandomized inputs are the same on
# every run (new ones come from `dev` runs, which draw afresh each time), 100 under `quick`
MANY = settings(max_examples=10 * settings().max_examples)


def near_keys() -> st.SearchStrategy[str]:
    """Text close to valid keys: valid keys with one character changed, added or dropped."""

    @st.composite
    def mutate(draw: st.DrawFn) -> str:
        text = draw(key_texts())
        i = draw(st.integers(0, len(text)))
        char = draw(st.one_of(st.sampled_from("@%_+-~.0aAfFgG/ \n\u0661\u00e4%2f"), st.characters()))
        op = draw(st.sampled_from(["insert", "replace", "delete"]))
        if op == "insert":
            return text[:i] + char + text[i:]
        if op == "replace":
            return text[:i] + char + text[i + 1 :]
        return text[:i] + text[i + 1 :]

    return mutate()


@MANY
@given(embedding_keys())
@example(EmbeddingKey("@", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(0)))
@example(EmbeddingKey("model@rev", Modality.AUDIO, HashScheme.SGLANG, mm_hash(2**64 - 1)))
@example(EmbeddingKey("%41", Modality.VIDEO, HashScheme.XXH3, mm_hash(2**128 - 1)))
@example(EmbeddingKey("a/b:c*d?e", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1)))
@example(EmbeddingKey("\x00", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1)))
@example(EmbeddingKey("x" * 256, Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1)))
def test_from_key_inverts_to_key(key: EmbeddingKey) -> None:
    text = key.to_key()
    assert EmbeddingKey.from_key(text) == key
    assert ALPHABET.fullmatch(text)
    assert len(text.split("@")) == 5


@MANY
@given(st.one_of(st.text(), near_keys(), key_texts()))
@example("mmk1@ns@image@blake3@" + "0" * 31 + "A")  # upper-case hex
@example("mmk1@ns@image@blake3@+" + "0" * 31)  # sign
@example("mmk1@ns@image@blake3@" + "0" * 15 + "_" + "0" * 16)  # digit separator
@example("mmk1@ns@image@blake3@" + "\u0661" * 32)  # Unicode digits
@example("mmk1@ns@image@blake3@" + "0" * 32 + "\n")  # trailing newline
@example("mmk1@a%2fb@image@blake3@" + "0" * 32)  # lower-case escape
@example("mmk1@%41@image@blake3@" + "0" * 32)  # escaped unreserved byte
@example("mmk1@ns@image@sglang@" + "0" * 32)  # digest wider than its scheme
@example("mmk1@ns@image@blake3@" + "1" * 16)  # 64-bit digest under a 128-bit scheme
def test_from_key_accepts_exactly_what_to_key_writes(text: str) -> None:
    try:
        key = EmbeddingKey.from_key(text)
    except InvalidKey:
        return
    assert key.to_key() == text


@MANY
@given(embedding_keys(), embedding_keys())
@example(
    EmbeddingKey("a", Modality.IMAGE, HashScheme.SGLANG, mm_hash(1)),
    EmbeddingKey("a", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1)),
)
@example(
    EmbeddingKey("a@image", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1)),
    EmbeddingKey("a", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1)),
)
@example(
    EmbeddingKey("a/b", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1)),
    EmbeddingKey("a_b", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1)),
)
def test_distinct_keys_give_distinct_text(a: EmbeddingKey, b: EmbeddingKey) -> None:
    assert (a == b) == (a.to_key() == b.to_key())


@given(embedding_keys())
def test_keys_are_safe_file_names_without_offload_rewrites(key: EmbeddingKey) -> None:
    text = key.to_key()
    assert not set(text) & set('/\\:*?"<>| \t\r\n')
    assert text.isascii() and text.isprintable()


@st.composite
def digest_batches(draw: st.DrawFn) -> tuple[EmbeddingKey, list[int]]:
    """A key giving the shared parts, and digests in its scheme's range (bounds included)."""
    key = draw(embedding_keys())
    top = 2**key.scheme.bits - 1
    digests = draw(st.lists(st.one_of(st.integers(0, top), st.sampled_from([0, 1, top])), max_size=40))
    return key, digests


@MANY
@given(digest_batches())
@example((EmbeddingKey("m", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(0)), [0, 2**128 - 1, 0]))
@example((EmbeddingKey("%", Modality.AUDIO, HashScheme.SGLANG, mm_hash(0)), [5, 2**64 - 1]))
def test_for_digests_fast_path_gives_exactly_the_constructors_keys(
    batch: tuple[EmbeddingKey, list[int]],
) -> None:
    parts, digests = batch
    shared = (parts.namespace, parts.modality, parts.scheme)
    fast = EmbeddingKey.for_digests(*shared, [mm_hash(d) for d in digests])
    slow = [EmbeddingKey(*shared, mm_hash(d)) for d in digests]
    assert fast == slow
    assert [type(k) for k in fast] == [EmbeddingKey] * len(slow)
    assert [(k.namespace, k.modality, k.scheme, k.digest) for k in fast] == [
        (k.namespace, k.modality, k.scheme, k.digest) for k in slow
    ]
    assert [type(k.digest) for k in fast] == [int] * len(slow)
    assert [k.to_key() for k in fast] == [k.to_key() for k in slow]
    assert [hash(k) for k in fast] == [hash(k) for k in slow]
    assert [repr(k) for k in fast] == [repr(k) for k in slow]
    assert [EmbeddingKey.from_key(k.to_key()) for k in fast] == slow
