"""The stored form of one embedding: a self-describing, checksummed entry (format v1).

An entry is a header followed by the tensor's bytes. All integers are little-endian::

    offset  size      field
    0       4         magic b"MMKE"
    4       1         format version (1)
    5       1         dtype code (`DTYPE_CODES`)
    6       1         ndim (0 to 64)
    7       1         flags (0)
    8       2         key length K in bytes
    10      2         header length H: the payload offset, a multiple of 64
    12      4         reserved (0)
    16      8         payload length P in bytes
    24      16        checksum: XXH3-128 (canonical, big-endian) of bytes [0, 24) and [40, H + P)
    40      8*ndim    shape, one u64 per dimension
    40+8n   K         the key text (ASCII)
    ...               zero padding up to H
    H       P         payload: the C-order element bytes

An entry is exactly ``H + P`` bytes. `decode_entry` checks every field and the checksum
against the key being read, so truncated, extended, bit-flipped or re-keyed entries raise
`CorruptEntry`; the checksum detects accidents, not forgeries. torch and xxhash load on
first use, never at ``import mmkey``.
"""

from __future__ import annotations

import ctypes
import math
import struct
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs

from mmkey._tensors import plain_cpu
from mmkey.errors import CorruptEntry, InvalidKey

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

__all__ = [
    "DTYPE_CODES",
    "FORMAT_VERSION",
    "HEADER_ALIGN",
    "MAGIC",
    "EntryHeader",
    "decode_entry",
    "encode_entry",
    "encode_entry_into",
    "entry_size",
    "peek_header",
]

MAGIC = b"MMKE"
"""The first four bytes of every entry."""
FORMAT_VERSION = 1
"""The entry format this module writes and reads."""
HEADER_ALIGN = 64
"""Headers are zero-padded to a multiple of this, so payloads start aligned."""
MAX_NDIM = 64
"""The most dimensions an entry may have."""

DTYPE_CODES: dict[str, int] = {
    "bool": 1,
    "uint8": 2,
    "int8": 3,
    "int16": 4,
    "int32": 5,
    "int64": 6,
    "float16": 7,
    "bfloat16": 8,
    "float32": 9,
    "float64": 10,
    "complex32": 11,
    "complex64": 12,
    "complex128": 13,
    "uint16": 14,
    "uint32": 15,
    "uint64": 16,
    "float8_e4m3fn": 17,
    "float8_e5m2": 18,
    "float8_e4m3fnuz": 19,
    "float8_e5m2fnuz": 20,
    "float8_e8m0fnu": 21,
    "float4_e2m1fn_x2": 22,
    "bits8": 23,
    "bits16": 24,
    "bits1x8": 25,
    "bits2x4": 26,
    "bits4x2": 27,
}
"""The dtype byte of format v1, by torch dtype name. Codes are never reused or changed."""

_FIXED = struct.Struct("<4sBBBBHHIQ16s")
_FIXED_SIZE = _FIXED.size  # 40
_DIGEST_AT = 24
_MAX_KEY_BYTES = 8192  # the longest v1 key is ~3.1 KB; the header length must fit a u16
_PyBUF_READ = 0x100
_PyBUF_WRITE = 0x200
_FUSED_MAX = 256 << 10
"""`decode_entry` copies payloads up to this size and then hashes the copy (see there)."""
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]


@attrs.frozen(slots=True)
class EntryHeader:
    """What an entry's header says, read by `peek_header` before any checksum is verified."""

    key: str
    """The key text the entry was written under."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    header_size: int
    """Offset of the payload; a multiple of `HEADER_ALIGN`."""
    payload_size: int

    @property
    def entry_size(self) -> int:
        """Total bytes of the entry: header and payload."""
        return self.header_size + self.payload_size


class _Runtime:
    """torch, xxhash and the dtype tables, loaded on first use."""

    def __init__(self) -> None:
        import torch
        import xxhash

        self.xxh3_128: Callable[..., Any] = xxhash.xxh3_128
        self.code_of: dict[torch.dtype, int] = {}
        self.dtype_of: dict[int, torch.dtype] = {}
        for name, code in DTYPE_CODES.items():
            dtype = getattr(torch, name, None)
            if isinstance(dtype, torch.dtype):
                self.code_of[dtype] = code
                self.dtype_of[code] = dtype
        # torch warns once per process when it wraps a read-only buffer; decode only ever
        # clones such a wrapper (never writes through it), so take that one warning here,
        # and the "experimental" one of complex32.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.frombuffer(b"\0", dtype=torch.uint8)
            # an empty tensor per dtype: `blank[dtype].new_empty(shape)` allocates the fastest
            self.blank: dict[torch.dtype, torch.Tensor] = {
                dtype: torch.empty(0, dtype=dtype) for dtype in self.code_of
            }
        # a memoryview over a CPU tensor's bytes without numpy: (address, size, flags)
        prototype = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
        self.memory_view: Callable[[int, int, int], memoryview] = prototype(
            ("PyMemoryView_FromMemory", ctypes.pythonapi)
        )


_runtime: _Runtime | None = None


def _rt() -> _Runtime:
    global _runtime
    if _runtime is None:
        _runtime = _Runtime()
    return _runtime


def _header_size(ndim: int, key_len: int) -> int:
    unpadded = _FIXED_SIZE + 8 * ndim + key_len
    return -(-unpadded // HEADER_ALIGN) * HEADER_ALIGN


def _key_bytes(key: str) -> bytes:
    value: object = key
    if type(value) is str and key.isascii() and 0 < len(key) <= _MAX_KEY_BYTES:
        return key.encode("ascii")  # the common case, checked in one go
    if not isinstance(value, str):
        raise TypeError(
            f"entry keys are key text (str), got {type(value).__name__}; "
            "pass key.to_key() or mmkey.keys.key_text(key)"
        )
    try:
        raw = key.encode("ascii")
    except UnicodeEncodeError:
        raise InvalidKey(f"entry key {key[:80]!r} is not ASCII key text") from None
    if not 0 < len(raw) <= _MAX_KEY_BYTES:
        raise InvalidKey(f"entry keys need 1 to {_MAX_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def _plain_cpu(tensor: torch.Tensor, rt: _Runtime) -> tuple[torch.Tensor, int]:
    """`tensor` as a contiguous CPU tensor without conj/neg bits, and its dtype code."""
    t = plain_cpu(
        tensor, "store", "embeddings must be torch.Tensor", "convert with torch.as_tensor(x)"
    )
    code = rt.code_of.get(t.dtype)
    if code is None:
        raise TypeError(f"cannot store dtype {t.dtype}; convert it to a standard dtype first")
    if t.dim() > MAX_NDIM:
        raise ValueError(f"cannot store a tensor with {t.dim()} dims (at most {MAX_NDIM})")
    return t, code


def _header(key: bytes, t: torch.Tensor, code: int, payload: int) -> bytearray:
    """The header with a zero checksum field."""
    size = _header_size(t.dim(), len(key))
    head = bytearray(size)
    _FIXED.pack_into(head, 0, MAGIC, FORMAT_VERSION, code, t.dim(), 0, len(key), size, 0, payload, b"")
    _SHAPES[t.dim()].pack_into(head, _FIXED_SIZE, *t.shape)
    at = _FIXED_SIZE + 8 * t.dim()
    head[at : at + len(key)] = key
    return head


def entry_size(key: str, tensor: torch.Tensor) -> int:
    """Bytes `encode_entry` writes for `tensor` under `key`: header plus payload."""
    import torch

    value: object = tensor
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"embeddings must be torch.Tensor, got {type(value).__name__}")
    return _header_size(tensor.dim(), len(_key_bytes(key))) + tensor.numel() * tensor.element_size()


def encode_entry(key: str, tensor: torch.Tensor) -> bytes:
    """The entry of `tensor` stored under key text `key` (see the module doc for the layout).

    Any strided tensor of a `DTYPE_CODES` dtype on any device; it is copied, never kept.
    """
    rt = _rt()
    raw_key = _key_bytes(key)
    t, code = _plain_cpu(tensor, rt)
    nbytes = t.numel() * t.element_size()
    head = _header(raw_key, t, code, nbytes)
    payload = rt.memory_view(t.data_ptr(), nbytes, _PyBUF_READ) if nbytes else b""
    view = memoryview(head)
    checksum = rt.xxh3_128(view[:_DIGEST_AT])
    checksum.update(view[_FIXED_SIZE:])
    checksum.update(payload)
    head[_DIGEST_AT:_FIXED_SIZE] = checksum.digest()
    return b"".join((head, payload))


def encode_entry_into(buf: Buffer, key: str, tensor: torch.Tensor) -> int:
    """Write the entry of `tensor` at the start of the writable buffer `buf`; bytes written.

    For registered (pinned) memory: size the region with `entry_size`. Raises `ValueError`
    when `buf` is read-only or too small; the bytes after the entry are left untouched.
    """
    rt = _rt()
    raw_key = _key_bytes(key)
    t, code = _plain_cpu(tensor, rt)
    nbytes = t.numel() * t.element_size()
    head = _header(raw_key, t, code, nbytes)
    out = _byte_view(buf)
    total = len(head) + nbytes
    if out.readonly:
        raise ValueError("encode_entry_into() needs a writable buffer (bytearray, memoryview)")
    if out.nbytes < total:
        raise ValueError(f"buffer holds {out.nbytes} bytes, the entry needs {total}")
    out[: len(head)] = head
    if nbytes:
        import torch

        target = torch.frombuffer(out, dtype=torch.uint8, count=nbytes, offset=len(head))
        target.copy_(t.reshape(-1).view(torch.uint8))
    checksum = rt.xxh3_128(out[:_DIGEST_AT])
    checksum.update(out[_FIXED_SIZE:total])
    out[_DIGEST_AT:_FIXED_SIZE] = checksum.digest()
    return total


def _byte_view(data: object) -> memoryview:
    if type(data) is bytes:
        return memoryview(data)  # always contiguous unsigned bytes
    if isinstance(data, str):
        raise TypeError("entries are bytes-like, got str; store entry bytes, not text")
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"entries are bytes-like (bytes, bytearray, memoryview), got {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("entry buffers must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class _Parsed(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    header_size: int
    payload_size: int
    stored_key: bytes


def _parse(view: memoryview, rt: _Runtime) -> _Parsed:
    """The header fields of entry `view`, checked for consistency (not the checksum)."""
    size = view.nbytes
    if size < _FIXED_SIZE:
        raise CorruptEntry(f"truncated entry: {size} bytes, a header needs at least {_FIXED_SIZE}")
    magic, version, code, ndim, flags, key_len, head, reserved, payload, _ = _FIXED.unpack_from(
        view
    )
    if magic != MAGIC:
        raise CorruptEntry(f"not an mmkey entry: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"entry format version {version}, this mmkey reads {FORMAT_VERSION}")
    if flags or reserved:
        raise CorruptEntry(f"entry flags {flags:#x} / reserved {reserved:#x} must be 0")
    dtype = rt.dtype_of.get(code)
    if dtype is None:
        raise CorruptEntry(f"entry dtype code {code} is unknown to this mmkey and torch")
    if ndim > MAX_NDIM or key_len == 0 or head != _header_size(ndim, key_len):
        raise CorruptEntry(
            f"entry header length {head} does not fit ndim {ndim} and key length {key_len}"
        )
    if size != head + payload:
        what = "truncated" if size < head + payload else "extended"
        raise CorruptEntry(f"{what} entry: {size} bytes, the header says {head + payload}")
    shape: tuple[int, ...] = _SHAPES[ndim].unpack_from(view, _FIXED_SIZE)
    numel = math.prod(shape)
    if numel * dtype.itemsize != payload or (not numel and any(dim >> 62 for dim in shape)):
        raise CorruptEntry(f"entry shape {shape} of {dtype} does not fit {payload} payload bytes")
    at = _FIXED_SIZE + 8 * ndim
    return _Parsed(dtype, shape, head, payload, view[at : at + key_len].tobytes())


def peek_header(data: Buffer) -> EntryHeader:
    """Read an entry's header without verifying its checksum; `CorruptEntry` if malformed.

    For routing and sizing only: the tensor itself comes from `decode_entry`, which verifies.
    """
    parsed = _parse(_byte_view(data), _rt())
    key = parsed.stored_key.decode("latin-1")
    return EntryHeader(key, parsed.dtype, parsed.shape, parsed.header_size, parsed.payload_size)


def decode_entry(key: str, data: Buffer, *, copy: bool = True) -> torch.Tensor:
    """The tensor stored in entry `data`, verified against key text `key`.

    Raises `CorruptEntry` (saying what failed) unless magic, version, dtype, shape, sizes,
    the key and the checksum all verify. The result never aliases `data`, unless
    ``copy=False``: then it is a view of `data`, which must be writable, owned by the caller
    and left unchanged while the tensor lives (e.g. a registered buffer handed over).
    `data` must not change while this runs.
    """
    rt = _runtime or _rt()
    raw_key = _key_bytes(key)
    view = _byte_view(data)
    dtype, shape, head, payload, stored_key = _parse(view, rt)
    if stored_key != raw_key:
        raise CorruptEntry(
            f"entry was written under key {stored_key[:120].decode('latin-1')!r}, "
            f"read as {key[:120]!r}"
        )
    import torch

    checksum = rt.xxh3_128(view[:_DIGEST_AT])
    checksum.update(view[_FIXED_SIZE:head])
    if copy and 0 < payload <= _FUSED_MAX:
        # Copy, then hash the copy while it is still in cache: one pass over the payload,
        # and the checksum covers exactly the bytes returned. Dropped unless it matches.
        out = rt.blank[dtype].new_empty(shape)
        target = rt.memory_view(out.data_ptr(), payload, _PyBUF_WRITE)
        target[:] = view[head:]
        checksum.update(target)
        if checksum.digest() != view[_DIGEST_AT:_FIXED_SIZE]:
            raise CorruptEntry(f"entry for key {key[:120]!r} fails its checksum")
        return out
    checksum.update(view[head:])
    if checksum.digest() != view[_DIGEST_AT:_FIXED_SIZE]:
        raise CorruptEntry(f"entry for key {key[:120]!r} fails its checksum")
    if not copy and view.readonly:
        raise ValueError("decode_entry(copy=False) needs a writable buffer it may alias")
    if not payload:
        return torch.empty(shape, dtype=dtype)
    # Larger payloads: torch's clone copies on all intra-op threads, which beats one
    # thread's copy-and-hash pass (see benchmarks/bench_cache.py).
    tensor = torch.frombuffer(view, dtype=dtype, count=payload // dtype.itemsize, offset=head)
    tensor = tensor.view(shape)
    return tensor.clone() if copy else tensor
