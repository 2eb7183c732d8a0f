"""SGLang hash text to keys (mmkey.integrations.sglang._keys): every text, injective, no truncation.

Needs no SGLang: the mapping is pure, so these run in every environment.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mmkey import EmbeddingKey, HashScheme, InvalidKey, Modality, identifier_digest
from mmkey.integrations.sglang._keys import SGLANG_HASH_LIMIT, sglang_digest, sglang_key

MANY = settings(max_examples=10 * settings().max_examples)  # as the key format's own proofs
CANONICAL = re.compile(r"0|[1-9][0-9]*")


def hash_values() -> st.SearchStrategy[int]:
    """Non-negative ints of every width SGLang may hand over, edges weighted in."""
    edges = st.sampled_from(
        [0, 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1, 2**64, 2**64 + 1, 2**128 - 1, 2**128, 10**19, 10**20]
    )
    widths = st.integers(0, 300).flatmap(lambda bits: st.integers(0, 2**bits))
    return st.one_of(edges, widths)


def hash_texts() -> st.SearchStrategy[str]:
    """Decimal text of ints of every width, and junk near it."""
    decimal = hash_values().map(str)
    junk_char = st.sampled_from(list("0123456789 +-_\n\t.e") + ["\u0661", "\uff11", "\u00b2", "0x"])
    near = st.tuples(decimal, st.integers(0, 25), junk_char).map(lambda t: t[0][: t[1]] + t[2] + t[0][t[1] :])
    return st.one_of(decimal, near, st.text(max_size=30))


@MANY
@given(hash_values())
@example(0)
@example(2**64 - 1)
@example(2**64)
def test_narrow_values_keep_their_sglang_digest_wide_ones_become_identifiers(value: int) -> None:
    scheme, digest = sglang_digest(str(value))
    if value < SGLANG_HASH_LIMIT:
        assert (scheme, digest) == (HashScheme.SGLANG, value)
    else:
        assert (scheme, digest) == (HashScheme.ID, identifier_digest(str(value)))


@MANY
@given(hash_texts(), hash_texts())
@example("1", "01")
@example("18446744073709551615", "18446744073709551616")
@example("0", "")
@example("7", "\u0667")  # ARABIC-INDIC DIGIT SEVEN: int() reads it as 7
@example("1000", "1_000")  # int() reads it as 1000
@example("5", " 5")
@example("5", "5\n")
@example("5", "+5")
@example(str(2**64 + 5), str(5))  # never truncated into the 64-bit scheme
def test_distinct_hash_texts_never_share_a_key(a: str, b: str) -> None:
    keys: list[str | None] = []
    for text in (a, b):
        try:
            keys.append(sglang_key("model", Modality.IMAGE, text).to_key())
        except InvalidKey:
            assert text == "" or any(0xD800 <= ord(c) < 0xE000 for c in text)
            keys.append(None)
    if a != b and None not in keys:
        assert keys[0] != keys[1]
    if a == b:
        assert keys[0] == keys[1]


@MANY
@given(hash_texts(), st.sampled_from([HashScheme.SGLANG, HashScheme.BLAKE3]))
@example("-1", HashScheme.SGLANG)
@example("00", HashScheme.SGLANG)
@example("1e3", HashScheme.SGLANG)
@example("\u0661\u0662", HashScheme.SGLANG)
@example("a caller's hash: cat.png", HashScheme.SGLANG)
@example(str(2**127 + 3), HashScheme.BLAKE3)
def test_every_hash_text_maps_to_a_key_that_round_trips(text: str, hashes: HashScheme) -> None:
    if text == "":
        with pytest.raises(InvalidKey, match="empty"):
            sglang_key("model", Modality.AUDIO, text, hashes)
        return
    key = sglang_key("model", Modality.AUDIO, text, hashes)
    assert EmbeddingKey.from_key(key.to_key()) == key
    limit = SGLANG_HASH_LIMIT if hashes is HashScheme.SGLANG else 2**128
    if CANONICAL.fullmatch(text) is not None and int(text) < limit:
        assert (key.scheme, key.digest) == (hashes, int(text))
    else:
        assert (key.scheme, key.digest) == (HashScheme.ID, identifier_digest(text))


def test_blake3_hashes_keep_128_bits_under_the_blake3_scheme() -> None:
    wide = 2**127 + 12345
    key = sglang_key("model", Modality.IMAGE, str(wide), HashScheme.BLAKE3)
    assert (key.scheme, key.digest) == (HashScheme.BLAKE3, wide)
    # the same text read as SGLang's own 64-bit hash is an identifier: never truncated
    assert sglang_key("model", Modality.IMAGE, str(wide)).scheme is HashScheme.ID


def test_keys_carry_namespace_and_modality() -> None:
    image = sglang_key("qwen@1", Modality.IMAGE, "42")
    assert image.to_key() == "mmk1@qwen%401@image@sglang@000000000000002a"
    assert sglang_key("qwen@2", Modality.IMAGE, "42") != image
    assert sglang_key("qwen@1", Modality.AUDIO, "42") != image


def test_huge_text_is_an_identifier_without_int_conversion() -> None:
    text = "9" * 10_000  # beyond int()'s default 4300-digit limit for str conversion
    assert sglang_digest(text) == (HashScheme.ID, identifier_digest(text))


def test_non_text_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"str\(h\)"):
        sglang_digest(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["5", "not a number"])
def test_a_scheme_sglang_never_hashes_with_is_a_type_error_for_any_text(text: str) -> None:
    with pytest.raises(TypeError, match=r"hashes must be HashScheme\.SGLANG or HashScheme\.BLAKE3"):
        sglang_digest(text, HashScheme.ID)


# -- a caller's own hashes (/encode's "hashes" field) never name the server's entries -----------


@given(text=hash_texts(), value=hash_values(), hashes=st.sampled_from([HashScheme.SGLANG, HashScheme.BLAKE3]))
@example(text="1", value=1, hashes=HashScheme.SGLANG)  # a caller naming its pixels by a server hash
@example(text="18446744073709551615", value=2**64 - 1, hashes=HashScheme.SGLANG)
def test_a_caller_hash_is_an_identifier_apart_from_every_server_hash(
    text: str, value: int, hashes: HashScheme
) -> None:
    from mmkey.integrations.sglang._caller_hashes import caller_text

    caller = sglang_key("model", Modality.IMAGE, caller_text(text), hashes)
    server = sglang_key("model", Modality.IMAGE, str(value), hashes)
    assert caller.scheme is HashScheme.ID
    assert caller != server
    assert caller == sglang_key("model", Modality.IMAGE, caller_text(text), hashes)  # callers share


def test_scoping_rewrites_each_requests_hashes_into_new_dicts() -> None:
    from mmkey.integrations.sglang._caller_hashes import scope_caller_hashes

    own = {"req_id": "r0", "mm_items": ["x"]}
    named = {"req_id": "r1", "mm_items": ["y", "z"], "hashes": [123, "abc"]}
    encoder = object()
    changed = scope_caller_hashes(encoder, [own, named], "IMAGE", use_global_cache=True)
    assert changed is not None
    args, kwargs = changed
    assert args[0] is encoder and args[2] == "IMAGE" and kwargs == {"use_global_cache": True}
    assert args[1][0] is own
    assert args[1][1] == {"req_id": "r1", "mm_items": ["y", "z"], "hashes": ["caller:123", "caller:abc"]}
    assert named["hashes"] == [123, "abc"]  # the caller's dict is left as it was
    by_keyword = scope_caller_hashes(encoder, requests=[named], modality="IMAGE", use_global_cache=True)
    assert by_keyword is not None
    assert by_keyword[1]["requests"][0]["hashes"] == ["caller:123", "caller:abc"]
    only_requests = scope_caller_hashes(encoder, [named])  # the requests the last positional
    assert only_requests is not None and only_requests[0][1][0]["hashes"] == ["caller:123", "caller:abc"]


@pytest.mark.parametrize(
    "requests",
    [[{"req_id": "r", "mm_items": ["x"]}], [{"req_id": "r", "hashes": None}], "not a list", []],
)
def test_scoping_leaves_calls_without_caller_hashes_alone(requests: object) -> None:
    from mmkey.integrations.sglang._caller_hashes import scope_caller_hashes

    assert scope_caller_hashes(object(), requests, "IMAGE", use_global_cache=True) is None
    assert scope_caller_hashes(object()) is None


def test_hashes_that_are_not_a_list_are_scoped_as_sglang_flattens_them() -> None:
    from mmkey.integrations.sglang._caller_hashes import scope_caller_hashes

    changed = scope_caller_hashes(object(), [{"hashes": "12"}, {"hashes": 7}], "IMAGE")
    assert changed is not None
    text, number = changed[0][1]
    assert text["hashes"] == ["caller:1", "caller:2"]  # SGLang iterates a string's characters
    assert number["hashes"] == 7  # not iterable: SGLang's own length check refuses the request
