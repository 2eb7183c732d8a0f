"""hash_tensor() / hash_bytes(): framing, zero-copy views, independence of layout and process."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

import blake3
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import assume, example, given
from hypothesis import strategies as st

from mmkey import HashScheme, InvalidKey, hash_bytes, hash_tensor, identifier_digest
from mmkey.hashing import tensor_bytes
from mmkey.testing.strategies import feature_tensors

ALL_SCHEMES = [s for s in HashScheme if s.hashes_content]
FRAMED = [HashScheme.BLAKE3, HashScheme.XXH3]


def documented_frame(t: torch.Tensor) -> bytes:
    """The framing written out independently from the docs: domain, dtype, shape, length."""
    c = t.contiguous()
    data = c.view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    dtype = str(t.dtype).split(".")[1].encode()
    head = b"mmkey/tensor/v1\x00" + bytes([len(dtype)]) + dtype + bytes([t.dim()])
    head += b"".join(struct.pack("<Q", d) for d in t.shape) + struct.pack("<Q", len(data))
    return head + data


def sglang_reference(t: torch.Tensor) -> int:
    """SGLang's CPU tensor_hash, re-derived: SHA-256 of the flat C-order bytes, 8 bytes BE."""
    raw = t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big")


@given(feature_tensors())
def test_framed_schemes_match_the_documented_framing(t: torch.Tensor) -> None:
    frame = documented_frame(t)
    assert hash_tensor(t, HashScheme.BLAKE3) == int.from_bytes(blake3.blake3(frame).digest(16), "big")
    assert hash_tensor(t, HashScheme.XXH3) == xxhash.xxh3_128_intdigest(frame)


@given(feature_tensors())
def test_sglang_scheme_is_sha256_of_raw_bytes(t: torch.Tensor) -> None:
    assert hash_tensor(t, HashScheme.SGLANG) == sglang_reference(t)


@given(feature_tensors(max_dims=4), st.sampled_from(ALL_SCHEMES))
def test_strides_do_not_change_the_digest(t: torch.Tensor, scheme: HashScheme) -> None:
    assert hash_tensor(t, scheme) == hash_tensor(t.contiguous(), scheme)
    assert hash_tensor(t, scheme) == hash_tensor(t.clone(memory_format=torch.contiguous_format), scheme)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_non_contiguous_views_hash_like_their_copies(scheme: HashScheme) -> None:
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    for view in (base.transpose(0, 2), base[:, ::2], base[1:3, 2:5, ::3], base.permute(1, 2, 0)):
        assert not view.is_contiguous()
        assert hash_tensor(view, scheme) == hash_tensor(view.contiguous(), scheme)


@pytest.mark.parametrize("scheme", FRAMED)
def test_reshape_and_dtype_views_change_framed_digests(scheme: HashScheme) -> None:
    t = torch.arange(24, dtype=torch.float32)
    digests = {
        hash_tensor(t, scheme),
        hash_tensor(t.reshape(2, 12), scheme),
        hash_tensor(t.reshape(12, 2), scheme),
        hash_tensor(t.view(torch.int32), scheme),
        hash_tensor(t.view(torch.uint8), scheme),
    }
    assert len(digests) == 5


def test_sglang_scheme_ignores_shape_like_sglang() -> None:
    t = torch.arange(24, dtype=torch.float32)
    assert hash_tensor(t, HashScheme.SGLANG) == hash_tensor(t.reshape(4, 6), HashScheme.SGLANG)


def test_bf16_is_hashed_as_raw_bytes_without_upcast() -> None:
    t = torch.randn(64, 32).bfloat16()
    as_int16 = t.view(torch.int16)
    assert hash_tensor(t, HashScheme.SGLANG) == sglang_reference(as_int16)
    assert hash_tensor(t, HashScheme.SGLANG) != sglang_reference(t.float())
    assert hash_tensor(t, HashScheme.BLAKE3) != hash_tensor(t.float(), HashScheme.BLAKE3)


def test_tensor_bytes_is_a_zero_copy_view_of_contiguous_memory() -> None:
    t = torch.randn(128, 64)
    view = tensor_bytes(t)
    assert view.readonly
    assert view.nbytes == t.numel() * t.element_size()
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data == t.data_ptr()
    bf = t.bfloat16()
    assert np.frombuffer(tensor_bytes(bf), dtype=np.uint8).ctypes.data == bf.data_ptr()


def test_requires_grad_conj_and_neg_views_hash_their_values() -> None:
    t = torch.randn(8, 8, requires_grad=True)
    assert hash_tensor(t) == hash_tensor(t.detach().clone())
    c = torch.randn(4, dtype=torch.complex64)
    assert hash_tensor(c.conj()) == hash_tensor(c.conj().resolve_conj())


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_hash_bytes_accepts_every_bytes_like(scheme: HashScheme) -> None:
    raw = bytes(range(256)) * 3
    expected = hash_bytes(raw, scheme)
    assert hash_bytes(bytearray(raw), scheme) == expected
    assert hash_bytes(memoryview(raw), scheme) == expected
    assert hash_bytes(np.frombuffer(raw, dtype=np.float32).data, scheme) == expected
    strided = np.frombuffer(raw + raw, dtype=np.uint8).reshape(2, -1)[:, : len(raw)]
    assert hash_bytes(np.ascontiguousarray(strided[0]).data, scheme) == expected


def test_hash_bytes_of_non_contiguous_memory_hashes_c_order() -> None:
    arr = np.arange(64, dtype=np.uint8).reshape(8, 8)[:, ::2]
    assert not arr.data.c_contiguous
    assert hash_bytes(arr.data) == hash_bytes(arr.tobytes())


def test_hash_bytes_sglang_is_sha256_prefix() -> None:
    assert hash_bytes(b"abc", HashScheme.SGLANG) == int.from_bytes(hashlib.sha256(b"abc").digest()[:8], "big")


def test_hash_bytes_and_hash_tensor_are_separate_domains() -> None:
    raw = b"same bytes"
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    assert hash_bytes(raw) != hash_tensor(t)


@pytest.mark.parametrize("value", [[1.0, 2.0], 3, None, np.zeros(3)])
def test_hash_tensor_rejects_non_tensors(value: object) -> None:
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        hash_tensor(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "fix"), [("text", r"s\.encode\(\)"), (torch.zeros(2), "hash_tensor"), (7, "bytes-like")]
)
def test_hash_bytes_rejects_non_bytes(value: object, fix: str) -> None:
    with pytest.raises(TypeError, match=fix):
        hash_bytes(value)  # type: ignore[arg-type]


def test_bad_scheme_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="HashScheme"):
        hash_tensor(torch.zeros(2), "blake3")  # type: ignore[arg-type]


def test_sparse_tensors_are_refused() -> None:
    with pytest.raises(TypeError, match="to_dense"):
        hash_tensor(torch.eye(3).to_sparse())


def test_large_blake3_input_uses_the_parallel_path_with_the_same_digest() -> None:
    t = torch.randn(1024, 1024)
    frame = documented_frame(t)
    assert hash_tensor(t) == int.from_bytes(blake3.blake3(frame).digest(16), "big")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_cuda_tensors_hash_like_cpu_tensors(scheme: HashScheme) -> None:  # pragma: no cover
    t = torch.randn(256, 1176).bfloat16()
    assert hash_tensor(t.cuda(), scheme) == hash_tensor(t, scheme)
    assert hash_tensor(t.cuda().T, scheme) == hash_tensor(t.T, scheme)


@given(st.text(min_size=1), st.text(min_size=1))
@example("1", "01")
@example("a", "a\x00")
def test_identifier_digests_differ_for_different_text(a: str, b: str) -> None:
    assume(a != b)
    try:
        da, db = identifier_digest(a), identifier_digest(b)
    except InvalidKey:  # lone surrogates
        return
    assert da != db
    assert identifier_digest(a) == da


def test_identifier_digest_is_not_a_content_digest() -> None:
    assert identifier_digest("abc") != hash_bytes(b"abc", HashScheme.BLAKE3)


def test_identifier_digest_refuses_bad_input() -> None:
    with pytest.raises(TypeError, match="decode bytes first"):
        identifier_digest(b"abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"str\(x\)"):
        identifier_digest(123)  # type: ignore[arg-type]
    with pytest.raises(InvalidKey, match="empty"):
        identifier_digest("")
    with pytest.raises(InvalidKey, match="surrogates"):
        identifier_digest("\ud800")


@pytest.mark.parametrize("fn", [lambda s: hash_bytes(b"x", s), lambda s: hash_tensor(torch.zeros(2), s)])
def test_content_hashing_refuses_the_id_scheme(fn: Callable[[HashScheme], object]) -> None:
    with pytest.raises(ValueError, match="identifier_digest"):
        fn(HashScheme.ID)
