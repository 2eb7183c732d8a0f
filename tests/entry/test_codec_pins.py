"""Pins of entry format v1 that only a change of format may move: the dtype codes, the most
dimensions, and the errors that name the fix (found by a mutation pass, scripts/mutate.py)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from mmkey.entry.codec import DTYPE_CODES, MAX_NDIM, encode_entry, entry_header, entry_size, verify

KEY = "mmk1@pins@image@blake3@" + "0" * 31 + "1"


def test_the_dtype_codes_of_format_v1_never_change() -> None:
    names = [
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "bits8",
        "bits16",
        "bits1x8",
        "bits2x4",
        "bits4x2",
    ]
    assert {name: code for code, name in enumerate(names, start=1)} == DTYPE_CODES


def test_an_entry_has_at_most_64_dimensions() -> None:
    assert MAX_NDIM == 64
    most = torch.arange(2.0).reshape((2,) + (1,) * 63)
    got, _ = verify(KEY, encode_entry(KEY, most))
    assert got.shape == most.shape and torch.equal(got, most)
    too_many = most.reshape((2,) + (1,) * 64)
    for write in (encode_entry, entry_header):
        with pytest.raises(ValueError, match="65 dims \\(at most 64\\)"):
            write(KEY, too_many)


def test_text_given_as_an_entry_is_refused_naming_the_fix() -> None:
    with pytest.raises(TypeError, match="got str; store entry bytes, not text"):
        verify(KEY, "entry")  # type: ignore[call-overload]


def test_header_sizes_are_format_v1s() -> None:
    """40 fixed bytes (88 signed, with the MAC, its key id and the issue time), 8 per
    dimension, the key, padded to 64: a 72-byte key and 2 dimensions fill 128 exactly."""
    from mmkey.entry.auth import EntryKeyring
    from mmkey.entry.codec import peek_header

    key = "mmk1@" + "n" * 35 + "@image@blake3@" + "0" * 32
    assert len(key) == 86
    for key_len, signed, header in [(72, False, 128), (73, False, 192), (24, True, 128), (25, True, 192)]:
        text = key[:key_len]
        ring = EntryKeyring.from_secrets(hashlib.sha256(b"pins").digest()) if signed else None
        entry = encode_entry(text, torch.zeros(2, 3), keyring=ring)
        assert peek_header(entry).header_size == header, (key_len, signed)
        assert len(entry) == header + 24


def test_a_one_byte_key_text_is_an_entry_key() -> None:
    class Text(str):
        """A str subclass: the checked path of key text, not the fast one."""

    for key in ("k", Text("k")):
        got, _ = verify(key, encode_entry(key, torch.ones(2)))
        assert got.tolist() == [1.0, 1.0]


def test_an_unsigned_entry_that_fails_its_checksum_in_a_migration_window_is_forged_unsigned() -> None:
    import datetime

    import attrs

    from mmkey.entry.auth import EntryKeyring
    from mmkey.errors import ForgedEntry

    window = datetime.datetime(2999, 1, 1, tzinfo=datetime.timezone.utc)
    ring = attrs.evolve(EntryKeyring.from_secrets(hashlib.sha256(b"pins").digest()), migrate_until=window)
    entry = bytearray(encode_entry(KEY, torch.ones(4)))
    assert verify(KEY, bytes(entry), keyring=ring)[1] is True  # the control: served, unsigned
    entry[-1] ^= 1
    with pytest.raises(ForgedEntry, match="fails its checksum") as refused:
        verify(KEY, bytes(entry), keyring=ring)
    assert refused.value.reason == "unsigned"


def test_an_empty_entry_naming_a_huge_dimension_is_corrupt() -> None:
    import xxhash

    from mmkey.errors import CorruptEntry

    def with_shape(dims: tuple[int, int]) -> bytes:
        entry = bytearray(encode_entry(KEY, torch.zeros(0, 1)))
        entry[40:56] = dims[0].to_bytes(8, "little") + dims[1].to_bytes(8, "little")
        entry[24:40] = xxhash.xxh3_128(bytes(entry[:24]) + bytes(entry[40:])).digest()
        return bytes(entry)

    assert verify(KEY, with_shape((0, 2**62 - 1)))[0].shape == (0, 2**62 - 1)  # the control
    for dims in [(0, 2**62), (2**62, 0), (0, 2**63)]:
        with pytest.raises(CorruptEntry, match="does not fit 0 payload bytes"):
            verify(KEY, with_shape(dims))


def test_without_a_keyring_a_refusal_is_corrupt_not_forged() -> None:
    from mmkey.errors import CorruptEntry

    other = KEY[:-1] + "2"
    for data in (encode_entry(other, torch.ones(2)), b"MMKE" + bytes(60)):
        with pytest.raises(CorruptEntry) as refused:
            verify(KEY, data)
        assert type(refused.value) is CorruptEntry


def test_a_dtype_without_a_code_or_a_non_tensor_is_refused_naming_the_fix() -> None:
    uncoded = getattr(torch, "uint4", None)
    if isinstance(uncoded, torch.dtype):
        with pytest.raises(TypeError, match="cannot store dtype torch.uint4; convert it"):
            encode_entry(KEY, torch.empty(2, dtype=uncoded))
    with pytest.raises(TypeError, match="embeddings must be torch.Tensor, got list"):
        entry_size(KEY, [1.0, 2.0])  # type: ignore[arg-type]
