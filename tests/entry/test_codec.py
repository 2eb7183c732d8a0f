"""The entry codec: round trips for every dtype and shape, the byte layout, and refusals."""

from __future__ import annotations

import struct
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from mmkey import CorruptEntry, EmbeddingKey, HashScheme, InvalidKey, Modality, mm_hash
from mmkey.entry._format import _CHUNK, _DIGEST_AT
from mmkey.entry.codec import (
    DTYPE_CODES,
    HEADER_ALIGN,
    MAGIC,
    EntryHeader,
    decode_entry,
    encode_entry,
    encode_entry_into,
    entry_size,
    peek_header,
)

KEY = EmbeddingKey("qwen2-vl-7b", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(7)).to_key()
OTHER = EmbeddingKey("qwen2-vl-7b", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(8)).to_key()
DTYPES = [getattr(torch, name) for name in DTYPE_CODES if hasattr(torch, name)]


def raw(t: torch.Tensor) -> bytes:
    """The C-order bytes of `t`, whatever its dtype (NaN payloads included)."""
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).tolist())


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as `dtype` (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for dim in shape:
        numel *= dim
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    data = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return data.view(dtype).reshape(shape)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert raw(a) == raw(b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (5, 7), (2, 3, 4)], ids=str)
def test_round_trip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        t = sample(dtype, shape)
        data = encode_entry(KEY, t)
        out = decode_entry(KEY, data)
        into = bytearray(entry_size(KEY, t))
        written = encode_entry_into(into, KEY, t)
    assert_same(out, t)
    assert len(data) == written == entry_size(KEY, t)
    assert into == data


def test_bfloat16_bits_survive_without_conversion() -> None:
    bits = torch.tensor([0x7FC1, 0xFF80, 0x0001, 0x8000, 0x3F80], dtype=torch.int32).to(torch.uint16)
    t = bits.view(torch.bfloat16)
    out = decode_entry(KEY, encode_entry(KEY, t))
    assert out.dtype == torch.bfloat16
    assert out.view(torch.uint16).to(torch.int32).tolist() == bits.to(torch.int32).tolist()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24.0).reshape(4, 6).t(),
        lambda: torch.arange(40, dtype=torch.int64)[::3],
        lambda: torch.arange(6.0).reshape(1, 6).expand(3, 6),
        lambda: torch.arange(8.0, requires_grad=True) * 2,
        lambda: (torch.arange(4.0) + 1j * torch.arange(4.0)).conj(),
        lambda: torch.complex(torch.arange(4.0), torch.arange(4.0))[1:].conj().imag,
        lambda: torch.arange(10.0)[2:7],
    ],
    ids=["transposed", "strided", "expanded", "requires-grad", "conj-view", "neg-view", "offset"],
)
def test_views_store_their_values_in_c_order(make: Callable[[], torch.Tensor]) -> None:
    t = make()
    assert not t.is_contiguous() or t.is_conj() or t.is_neg() or t.requires_grad or t.storage_offset()
    data = encode_entry(KEY, t)
    out = decode_entry(KEY, data)
    assert out.is_contiguous()
    assert_same(out, t.detach().resolve_conj().resolve_neg().contiguous())
    into = bytearray(len(data))
    encode_entry_into(into, KEY, t)
    assert into == data


def test_decode_never_aliases_its_input() -> None:
    t = torch.arange(16.0)
    data = bytearray(encode_entry(KEY, t))
    out = decode_entry(KEY, data)
    data[-1] ^= 0xFF
    out.fill_(-1)
    assert_same(decode_entry(KEY, encode_entry(KEY, t)), t)
    assert decode_entry(KEY, memoryview(encode_entry(KEY, t))).tolist() == t.tolist()


def test_copy_false_aliases_a_writable_buffer_and_refuses_read_only() -> None:
    t = torch.arange(16.0)
    data = bytearray(encode_entry(KEY, t))
    view = decode_entry(KEY, data, copy=False)
    assert_same(view, t)
    view[0] = 99.0
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_entry(KEY, data)
    with pytest.raises(ValueError, match="writable"):
        decode_entry(KEY, encode_entry(KEY, t), copy=False)


def test_encode_into_writes_the_same_entry_and_nothing_after_it() -> None:
    t = sample(torch.bfloat16, (3, 5))
    size = entry_size(KEY, t)
    buf = bytearray(b"\xab" * (size + 16))
    assert encode_entry_into(buf, KEY, t) == size
    assert bytes(buf[:size]) == encode_entry(KEY, t)
    assert buf[size:] == b"\xab" * 16
    assert_same(decode_entry(KEY, memoryview(buf)[:size]), t)
    with pytest.raises(ValueError, match="needs"):
        encode_entry_into(bytearray(size - 1), KEY, t)
    with pytest.raises(ValueError, match="writable"):
        encode_entry_into(bytes(size), KEY, t)


def test_byte_layout_is_format_v1() -> None:
    t = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float32)
    data = encode_entry(KEY, t)
    key = KEY.encode("ascii")
    head = (40 + 16 + len(key) + HEADER_ALIGN - 1) // HEADER_ALIGN * HEADER_ALIGN
    fixed = struct.unpack_from("<4sBBBBHHIQ", data)
    assert fixed == (MAGIC, 1, DTYPE_CODES["float32"], 2, 0, len(key), head, 0, 12)
    assert struct.unpack_from("<2Q", data, 40) == (1, 3)
    assert data[56 : 56 + len(key)] == key
    assert data[56 + len(key) : head] == bytes(head - 56 - len(key))
    assert data[head:] == struct.pack("<3f", 1.0, 2.0, 3.0)
    digest = xxhash.xxh3_128(data[:24] + data[40:]).digest()
    assert data[24:40] == digest
    assert len(data) == head + 12


def test_golden_entry_never_changes() -> None:
    key = "mmk1@m@image@xxh3@" + "0" * 31 + "1"
    data = encode_entry(key, torch.tensor([1, -2], dtype=torch.int16))
    assert (
        data.hex()
        == (
            "4d4d4b45"
            "01"
            "04"
            "01"
            "00"
            "3200"
            "8000"
            "00000000"
            "0400000000000000"
            "78455c05f7b83a573b3fe111492c09d8"  # XXH3-128 of [0, 24) and [40, end)
            "0200000000000000" + key.encode().hex() + "00" * 30 + "0100"
            "feff"
        )
    )
    assert decode_entry(key, data).tolist() == [1, -2]


def test_peek_header_reads_without_verifying() -> None:
    t = sample(torch.float16, (2, 3))
    data = bytearray(encode_entry(KEY, t))
    header = peek_header(data)
    assert header == EntryHeader(KEY, torch.float16, (2, 3), header.header_size, 12)
    assert header.header_size % HEADER_ALIGN == 0
    assert header.entry_size == len(data)
    data[-1] ^= 1  # a payload flip: the header still reads
    assert peek_header(data).key == KEY
    with pytest.raises(CorruptEntry, match="magic"):
        peek_header(b"XXXX" + bytes(data[4:]))


ENTRIES = [
    encode_entry(KEY, sample(torch.float32, (4, 8), 1)),
    encode_entry(KEY, sample(torch.bfloat16, (3,), 2)),
    encode_entry(KEY, torch.tensor(True)),
    encode_entry(KEY, torch.empty(0, 5, dtype=torch.int64)),
    encode_entry(KEY, sample(torch.complex64, (2, 2), 3)),
]


@given(st.sampled_from(ENTRIES), st.data())
def test_any_bit_flip_is_refused(entry: bytes, data: st.DataObject) -> None:
    spots = data.draw(
        st.sets(st.tuples(st.integers(0, len(entry) - 1), st.integers(0, 7)), min_size=1, max_size=8)
    )
    broken = bytearray(entry)
    for at, bit in spots:
        broken[at] ^= 1 << bit
    with pytest.raises(CorruptEntry):
        decode_entry(KEY, broken)


@given(st.sampled_from(ENTRIES), st.data())
def test_any_truncation_is_refused(entry: bytes, data: st.DataObject) -> None:
    size = data.draw(st.integers(0, len(entry) - 1))
    with pytest.raises(CorruptEntry):
        decode_entry(KEY, entry[:size])


@given(st.sampled_from(ENTRIES), st.binary(min_size=1, max_size=200))
def test_any_extension_is_refused(entry: bytes, tail: bytes) -> None:
    with pytest.raises(CorruptEntry, match="extended"):
        decode_entry(KEY, entry + tail)


@given(st.sampled_from(ENTRIES), st.integers(0, 2**128 - 1), st.sampled_from(list(Modality)))
def test_an_entry_read_under_another_key_is_refused(entry: bytes, digest: int, modality: Modality) -> None:
    other = EmbeddingKey("qwen2-vl-7b", modality, HashScheme.BLAKE3, mm_hash(digest)).to_key()
    if other == KEY:
        return
    with pytest.raises(CorruptEntry, match="written under key"):
        decode_entry(other, entry)


def test_a_rekeyed_header_fails_its_checksum() -> None:
    entry = bytearray(ENTRIES[0])
    at = entry.index(KEY.encode())
    entry[at : at + len(OTHER)] = OTHER.encode()  # same length: only the checksum can tell
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_entry(OTHER, entry)


@pytest.mark.parametrize(
    ("at", "value", "message"),
    [
        (0, b"NOPE", "magic"),
        (4, b"\x02", "version"),
        (5, b"\xee", "dtype code"),
        (7, b"\x02", "flags"),
        (10, b"\x00\x01", "header length"),
        (16, struct.pack("<Q", 999), "truncated"),
    ],
)
def test_messages_say_what_failed(at: int, value: bytes, message: str) -> None:
    entry = bytearray(ENTRIES[0])
    entry[at : at + len(value)] = value
    with pytest.raises(CorruptEntry, match=message):
        decode_entry(KEY, entry)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_wrong_argument_types_name_the_fix() -> None:
    t = torch.zeros(2)
    key_obj = EmbeddingKey.from_key(KEY)
    with pytest.raises(TypeError, match="to_key"):
        encode_entry(key_obj, t)  # type: ignore[arg-type]
    with pytest.raises(InvalidKey, match="ASCII"):
        encode_entry("mmk1@caf\u00e9", t)
    with pytest.raises(InvalidKey, match="1 to 8192 bytes"):
        encode_entry("", t)
    with pytest.raises(InvalidKey, match="1 to 8192 bytes"):
        encode_entry("k" * 8193, t)
    longest = EmbeddingKey("\U0001f642" * 256, Modality.AUDIO, HashScheme.XXH3, mm_hash(1)).to_key()
    assert decode_entry(longest, encode_entry(longest, t)).tolist() == [0.0, 0.0]
    with pytest.raises(TypeError, match="as_tensor"):
        encode_entry(KEY, [1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="to_dense"):
        encode_entry(KEY, torch.eye(2).to_sparse())
    with pytest.raises(TypeError, match="dequantize"):
        encode_entry(KEY, torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8))
    with pytest.raises(TypeError, match="bytes-like"):
        decode_entry(KEY, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes-like"):
        decode_entry(KEY, 12)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous"):
        decode_entry(KEY, memoryview(ENTRIES[0])[::2])


def test_importing_the_codec_loads_neither_torch_nor_xxhash() -> None:
    code = "import sys, mmkey.entry.codec; print('torch' in sys.modules, 'xxhash' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("payload", [_CHUNK - 8, _CHUNK, _CHUNK + 8, 3 * _CHUNK])
def test_chunked_copies_round_trip_and_refuse_a_flip_at_either_end(payload: int) -> None:
    """Payloads are copied and hashed a chunk at a time: one chunk, exactly one, and more."""
    t = torch.randint(-128, 128, (payload // 8, 8), dtype=torch.int8)
    entry = encode_entry(KEY, t)
    head = len(entry) - payload
    for data in (entry, bytearray(entry), memoryview(entry)):
        out = decode_entry(KEY, data)
        assert_same(out, t)
        if isinstance(data, bytearray):
            data[head] ^= 0xFF
            assert_same(out, t)
    for at in (0, _DIGEST_AT, head, head + 1, len(entry) - 2, len(entry) - 1):
        broken = bytearray(entry)
        broken[at] ^= 0x10
        with pytest.raises(CorruptEntry):
            decode_entry(KEY, bytes(broken))
