"""EmbeddingKey and key format v1: construction, text, the strict parser."""

from __future__ import annotations

import pickle

import attrs
import pytest

from mmkey import (
    CacheKey,
    EmbeddingKey,
    HashScheme,
    InvalidDigest,
    InvalidKey,
    MMHash,
    Modality,
    mm_hash,
)
from mmkey.keys import key_text

KEY = EmbeddingKey("qwen2-vl-7b", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(0xABC))
TEXT = "mmk1@qwen2-vl-7b@image@blake3@00000000000000000000000000000abc"


def test_to_key_writes_format_v1() -> None:
    assert KEY.to_key() == TEXT
    assert EmbeddingKey.from_key(TEXT) == KEY


def test_keys_are_frozen_slotted_hashable_and_picklable() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        KEY.namespace = "other"  # type: ignore[misc]
    assert not hasattr(KEY, "__dict__")
    assert {KEY: 1}[EmbeddingKey.from_key(TEXT)] == 1
    assert pickle.loads(pickle.dumps(KEY)) == KEY


def test_embedding_key_is_a_cache_key_and_digests_and_text_are_not() -> None:
    assert isinstance(KEY, CacheKey)
    assert not isinstance(MMHash(5), CacheKey)
    assert not isinstance(TEXT, CacheKey)


def test_namespace_is_percent_encoded_utf8_with_upper_case_hex() -> None:
    key = EmbeddingKey("org/model@v2 ä~", Modality.VIDEO, HashScheme.SGLANG, mm_hash(1))
    assert key.to_key() == "mmk1@org%2Fmodel%40v2%20%C3%A4~@video@sglang@0000000000000001"


def test_one_image_under_two_models_is_two_keys() -> None:
    a = EmbeddingKey("model-a", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(7))
    b = attrs.evolve(a, namespace="model-b")
    assert a != b and a.to_key() != b.to_key()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((1, Modality.IMAGE, HashScheme.BLAKE3, 1), TypeError, "namespace must be str"),
        (("", Modality.IMAGE, HashScheme.BLAKE3, 1), InvalidKey, "1 to 256 characters"),
        (("x" * 257, Modality.IMAGE, HashScheme.BLAKE3, 1), InvalidKey, "got 257"),
        (("\ud800", Modality.IMAGE, HashScheme.BLAKE3, 1), InvalidKey, "lone surrogates"),
        (("ns", "image", HashScheme.BLAKE3, 1), TypeError, r"Modality\('image'\)"),
        (("ns", Modality.IMAGE, "blake3", 1), TypeError, r"HashScheme\('blake3'\)"),
        (("ns", Modality.IMAGE, HashScheme.BLAKE3, "abc"), TypeError, "int digest"),
        (("ns", Modality.IMAGE, HashScheme.BLAKE3, True), InvalidDigest, "bool"),
        (("ns", Modality.IMAGE, HashScheme.BLAKE3, -1), InvalidDigest, "outside"),
        (("ns", Modality.IMAGE, HashScheme.BLAKE3, 2**128), InvalidDigest, "128-bit blake3"),
        (("ns", Modality.IMAGE, HashScheme.SGLANG, 2**64), InvalidDigest, "64-bit sglang"),
    ],
)
def test_bad_parts_are_refused_with_the_fix(args: tuple[object, ...], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        EmbeddingKey(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "must start with 'mmk1@'"),
        ("mmk2@ns@image@blake3@" + "0" * 32, "must start with 'mmk1@'"),
        ("MMK1@ns@image@blake3@" + "0" * 32, "must start with"),
        ("mmk1@ns@image@blake3", "5 '@'-separated parts"),
        ("mmk1@a@b@image@blake3@" + "0" * 32, "5 '@'-separated parts"),
        ("mmk1@ns@IMAGE@blake3@" + "0" * 32, "modality must be one of"),
        ("mmk1@ns@image@sha256@" + "0" * 32, "scheme must be one of"),
        ("mmk1@ns@image@blake3@" + "0" * 31 + "A", "lower-case hex"),
        ("mmk1@ns@image@blake3@" + "0" * 31 + "\n", "lower-case hex"),
        ("mmk1@ns@image@blake3@+" + "0" * 31, "lower-case hex"),
        ("mmk1@ns@image@blake3@" + "0" * 15 + "_" + "0" * 16, "lower-case hex"),
        ("mmk1@ns@image@blake3@" + "\u0661" * 32, "lower-case hex"),
        ("mmk1@ns@image@blake3@" + "0" * 31, "zero-padded to 32"),
        ("mmk1@ns@image@sglang@" + "0" * 32, "wider than sglang"),
        ("mmk1@@image@blake3@" + "0" * 32, "namespace must be percent-encoded"),
        ("mmk1@a b@image@blake3@" + "0" * 32, "percent-encoded"),
        ("mmk1@a/b@image@blake3@" + "0" * 32, "percent-encoded"),
        ("mmk1@a%2fb@image@blake3@" + "0" * 32, "percent-encoded"),
        ("mmk1@a%4@image@blake3@" + "0" * 32, "percent-encoded"),
        ("mmk1@%41@image@blake3@" + "0" * 32, "canonical form"),
        ("mmk1@%7E@image@blake3@" + "0" * 32, "canonical form"),
        ("mmk1@%FF@image@blake3@" + "0" * 32, "UTF-8"),
        ("mmk1@%ED%A0%80@image@blake3@" + "0" * 32, "UTF-8"),
        ("mmk1@" + "x" * 257 + "@image@blake3@" + "0" * 32, "got 257"),
        (" mmk1@ns@image@blake3@" + "0" * 32, "must start with"),
    ],
)
def test_parser_refuses_what_to_key_never_writes(text: str, match: str) -> None:
    with pytest.raises(InvalidKey, match=match):
        EmbeddingKey.from_key(text)


def test_too_wide_digest_is_invalid_digest() -> None:
    with pytest.raises(InvalidDigest):
        EmbeddingKey.from_key("mmk1@ns@image@blake3@1" + "0" * 32)


def test_from_key_needs_text() -> None:
    with pytest.raises(TypeError, match="decode"):
        EmbeddingKey.from_key(TEXT.encode())  # type: ignore[arg-type]


class ForeignKey:
    """A downstream CacheKey with its own text."""

    def __init__(self, text: object) -> None:
        self.text = text

    def to_key(self) -> str:
        return self.text  # type: ignore[return-value]


def test_key_text_accepts_any_cache_key_in_the_alphabet() -> None:
    assert key_text(KEY) == TEXT
    assert key_text(ForeignKey("emb_1234@a.b~c-d%20")) == "emb_1234@a.b~c-d%20"


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (MMHash(5), "bare digest"),
        (5, "bare digest"),
        (TEXT, r"EmbeddingKey\.from_key"),
        (b"x", "CacheKey objects"),
        (None, "CacheKey objects"),
    ],
)
def test_key_text_refuses_non_keys_naming_the_fix(value: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        key_text(value)


@pytest.mark.parametrize("text", ["", "a b", "a/b", "ä", "x\n", 5, None])
def test_key_text_refuses_foreign_text_outside_the_alphabet(text: object) -> None:
    with pytest.raises(InvalidKey):
        key_text(ForeignKey(text))


def test_for_digests_builds_the_same_keys_as_the_constructor() -> None:
    digests = [mm_hash(0), mm_hash(2**128 - 1), mm_hash(12345)]
    keys = EmbeddingKey.for_digests("org/m@1", Modality.AUDIO, HashScheme.XXH3, digests)
    expected = [EmbeddingKey("org/m@1", Modality.AUDIO, HashScheme.XXH3, d) for d in digests]
    assert keys == expected
    assert [k.to_key() for k in keys] == [k.to_key() for k in expected]
    assert [hash(k) for k in keys] == [hash(k) for k in expected]
    assert EmbeddingKey.for_digests("m", Modality.IMAGE, HashScheme.SGLANG, []) == []


class _Digest(int):
    """An int subclass, as a numpy or custom digest type may be."""


def test_for_digests_stores_plain_int_digests_of_int_subclasses() -> None:
    digests = [mm_hash(7), _Digest(8), _Digest(2**64 - 1)]
    keys = EmbeddingKey.for_digests("m", Modality.IMAGE, HashScheme.SGLANG, digests)  # type: ignore[arg-type]
    assert keys == [EmbeddingKey("m", Modality.IMAGE, HashScheme.SGLANG, mm_hash(d)) for d in digests]
    assert [type(k.digest) for k in keys] == [int, int, int]
    assert [k.to_key() for k in keys] == [EmbeddingKey.from_key(k.to_key()).to_key() for k in keys]
    assert keys[2].to_key().endswith("@" + "f" * 16)


@pytest.mark.parametrize(
    ("parts", "digests", "error"),
    [
        (("", Modality.IMAGE, HashScheme.BLAKE3), [], InvalidKey),
        (("m", "image", HashScheme.BLAKE3), [mm_hash(1)], TypeError),
        (("m", Modality.IMAGE, HashScheme.SGLANG), [mm_hash(1), mm_hash(2**64)], InvalidDigest),
        (("m", Modality.IMAGE, HashScheme.BLAKE3), [mm_hash(1), True], InvalidDigest),
        (("m", Modality.IMAGE, HashScheme.BLAKE3), [mm_hash(1), "2"], TypeError),
    ],
)
def test_for_digests_checks_every_part_and_digest(
    parts: tuple[object, object, object], digests: list[object], error: type
) -> None:
    with pytest.raises(error):
        EmbeddingKey.for_digests(*parts, digests)  # type: ignore[arg-type]
