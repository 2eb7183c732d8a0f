"""MMHash, mm_hash() and the scheme / modality enums."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmkey import HashScheme, InvalidDigest, InvalidKey, MMHash, Modality, mm_hash


def test_enum_values_are_the_key_text() -> None:
    assert [s.value for s in HashScheme] == ["blake3", "xxh3", "sglang", "id"]
    assert [m.value for m in Modality] == ["image", "video", "audio"]


@pytest.mark.parametrize(
    ("scheme", "bits", "width"),
    [
        (HashScheme.BLAKE3, 128, 32),
        (HashScheme.XXH3, 128, 32),
        (HashScheme.SGLANG, 64, 16),
        (HashScheme.ID, 128, 32),
    ],
)
def test_scheme_widths(scheme: HashScheme, bits: int, width: int) -> None:
    assert (scheme.bits, scheme.hex_width) == (bits, width)


def test_only_the_id_scheme_names_identifiers() -> None:
    assert [s for s in HashScheme if not s.hashes_content] == [HashScheme.ID]


@given(st.integers(0, 2**128 - 1))
def test_mm_hash_accepts_every_128_bit_int(n: int) -> None:
    h = mm_hash(n)
    assert h == n
    assert type(h) is int


@pytest.mark.parametrize("n", [-1, 2**128, 2**200, -(2**127)])
def test_mm_hash_rejects_out_of_range(n: int) -> None:
    with pytest.raises(InvalidDigest, match="outside the 128-bit range"):
        mm_hash(n)


def test_mm_hash_checks_the_schemes_width() -> None:
    assert mm_hash(2**64 - 1, HashScheme.SGLANG) == 2**64 - 1
    with pytest.raises(InvalidDigest, match="64-bit sglang"):
        mm_hash(2**64, HashScheme.SGLANG)


@pytest.mark.parametrize("flag", [True, False])
def test_mm_hash_rejects_bool(flag: bool) -> None:
    with pytest.raises(InvalidDigest, match="bool"):
        mm_hash(flag)


@pytest.mark.parametrize("value", ["5", 5.0, b"\x05", None])
def test_mm_hash_rejects_non_int_with_type_error(value: object) -> None:
    with pytest.raises(TypeError, match=r"int\(x\)"):
        mm_hash(value)  # type: ignore[arg-type]


def test_invalid_digest_is_a_value_error_and_invalid_key() -> None:
    assert issubclass(InvalidDigest, InvalidKey)
    assert issubclass(InvalidDigest, ValueError)


def test_mm_hash_returns_plain_int_for_int_subclass() -> None:
    class Sub(int):
        pass

    h = mm_hash(Sub(7))
    assert type(h) is int
    assert h == MMHash(7)
