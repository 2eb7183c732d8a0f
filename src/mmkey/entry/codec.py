"""The stored form of one embedding: a self-describing, checksummed entry (format v1).

An entry is a header followed by the tensor's bytes. All integers are little-endian::

    offset  size      field
    0       4         magic b"MMKE"
    4       1         format version (1)
    5       1         dtype code (`DTYPE_CODES`)
    6       1         ndim (0 to 64)
    7       1         flags: 0, `FLAG_AUTHENTICATED` (1), or that and `FLAG_ISSUED_AT` (3)
    8       2         key length K in bytes
    10      2         header length H: the payload offset, a multiple of 64
    12      4         reserved (0)
    16      8         payload length P in bytes
    24      16        checksum: XXH3-128 (canonical, big-endian) of bytes [0, 24) and [C, H + P)
    -- authenticated entries only (flags 1 and 3); C = 72 and S = 80 (88 with flag 3) for
    -- them, C = S = 40 otherwise:
    40      32        MAC: BLAKE3 keyed hash (under the MAC key derived from the secret) of
                      bytes [0, 40) and [72, H), then the 32-byte BLAKE3 hash of the payload:
                      every byte of the entry but the MAC's own, checksum included
    72      8         id of the secret whose derived MAC key made the MAC
    -- entries with an issue time (flag 3) only, which writers with a secret make:
    80      8         issued-at: seconds since the epoch (UTC) when the entry was signed
    --
    S       8*ndim    shape, one u64 per dimension
    S+8n    K         the key text (ASCII)
    ...               zero padding up to H
    H       P         payload: the C-order element bytes

An entry is exactly ``H + P`` bytes. `decode_entry` checks every field and the checksum
against the key being read, so truncated, extended, bit-flipped or re-keyed entries raise
`CorruptEntry`; the checksum detects accidents, not forgeries. Forgeries are what the MAC
stops: given an `EntryKeyring` (`mmkey.entry.auth`), `encode_entry` signs entries with its
current secret and `decode_entry` serves only entries whose MAC verifies under one of its
secrets that has not expired, raising `ForgedEntry` otherwise (every refusal under a
keyring is a `ForgedEntry`, with a ``reason``). A reader without a keyring decodes
authenticated entries after their checksum.

Readers verify what they return, not what they saw: the header is copied out of ``data``
first and parsed from that copy, and the payload is verified while it is copied, chunk by
chunk, into memory the caller gets (or private scratch memory): bytes that change in
``data`` meanwhile (memory registered with a transfer engine is writable from the network)
can make an entry fail, never make a tensor differ from the bytes that verified. torch,
xxhash and blake3 load on first use, never at ``import mmkey``.
"""

from __future__ import annotations

import ctypes
import hmac
import math
import struct
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs

from mmkey._tensors import plain_cpu
from mmkey.entry.auth import EntryKeyring
from mmkey.errors import CorruptEntry, ForgedEntry, InvalidKey

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

    from mmkey.entry.auth import EntrySecret

__all__ = [
    "DTYPE_CODES",
    "FLAG_AUTHENTICATED",
    "FLAG_ISSUED_AT",
    "FORMAT_VERSION",
    "HEADER_ALIGN",
    "MAGIC",
    "EntryHeader",
    "decode_entry",
    "decode_entry_into",
    "encode_entry",
    "encode_entry_into",
    "entry_header",
    "entry_size",
    "largest_entry_size",
    "peek_header",
    "verify_entry",
    "verify_entry_into",
]

MAGIC = b"MMKE"
"""The first four bytes of every entry."""
FORMAT_VERSION = 1
"""The entry format this module writes and reads."""
HEADER_ALIGN = 64
"""Headers are zero-padded to a multiple of this, so payloads start aligned."""
MAX_NDIM = 64
"""The most dimensions an entry may have."""
FLAG_AUTHENTICATED = 0x01
"""The flag of entries that carry a MAC and the id of the secret that made it."""
FLAG_ISSUED_AT = 0x02
"""With `FLAG_AUTHENTICATED` only: the entry carries the time it was signed (MAC-covered)."""
_FLAG_SETS = frozenset({0, FLAG_AUTHENTICATED, FLAG_AUTHENTICATED | FLAG_ISSUED_AT})

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
_MAC_AT = _FIXED_SIZE  # 40
_ID_AT = _MAC_AT + 32  # 72
_AUTH_END = _ID_AT + 8  # 80: where an authenticated entry's shape starts
_ISSUED_END = _AUTH_END + 8  # 88: ... and that of one with an issue time
_U64 = struct.Struct("<Q")
_clock: Callable[[], float] = time.time
"""Where signed entries take their issue time from."""
_CHUNK = 256 << 10
"""Payload bytes copied and then hashed at a time, while the copy is still in cache."""
_MAX_KEY_BYTES = 8192  # the longest v1 key is ~3.1 KB; the header length must fit a u16
_PyBUF_READ = 0x100
_PyBUF_WRITE = 0x200
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
    key_id: bytes | None = None
    """The id of the secret whose MAC the entry carries; None for an unauthenticated entry."""
    issued_at: int | None = None
    """When the entry was signed (seconds since the epoch), if it says."""

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


def _shape_at(flags: int) -> int:
    """Where the shape starts in an entry with `flags`."""
    if flags & FLAG_ISSUED_AT:
        return _ISSUED_END
    return _AUTH_END if flags & FLAG_AUTHENTICATED else _FIXED_SIZE


def _header_size(ndim: int, key_len: int, flags: int = 0) -> int:
    unpadded = _shape_at(flags) + 8 * ndim + key_len
    return -(-unpadded // HEADER_ALIGN) * HEADER_ALIGN


_SIGNED_FLAGS = FLAG_AUTHENTICATED | FLAG_ISSUED_AT
"""What writers with a secret set."""


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
    """``tensor`` as a contiguous CPU tensor without conj/neg bits, and its dtype code."""
    t = plain_cpu(tensor, "store", "embeddings must be torch.Tensor", "convert with torch.as_tensor(x)")
    code = rt.code_of.get(t.dtype)
    if code is None:
        raise TypeError(f"cannot store dtype {t.dtype}; convert it to a standard dtype first")
    if t.dim() > MAX_NDIM:
        raise ValueError(f"cannot store a tensor with {t.dim()} dims (at most {MAX_NDIM})")
    return t, code


def _signer(keyring: EntryKeyring | None) -> EntrySecret | None:
    """The secret new entries are signed with: the keyring's current one, if any."""
    if keyring is None:
        return None
    value: object = keyring
    if not isinstance(value, EntryKeyring):
        raise TypeError(
            f"keyring must be an EntryKeyring or None, got {type(value).__name__}; "
            "use mmkey.EntryKeyring.from_secrets(secret)"
        )
    return keyring.current


def _header(
    key: bytes, shape: tuple[int, ...], code: int, payload: int, secret: EntrySecret | None
) -> bytearray:
    """The header with zero checksum and MAC fields."""
    ndim = len(shape)
    flags = 0 if secret is None else _SIGNED_FLAGS
    size = _header_size(ndim, len(key), flags)
    head = bytearray(size)
    _FIXED.pack_into(head, 0, MAGIC, FORMAT_VERSION, code, ndim, flags, len(key), size, 0, payload, b"")
    at = _shape_at(flags)
    if secret is not None:
        head[_ID_AT:_AUTH_END] = secret.key_id
        _U64.pack_into(head, _AUTH_END, int(_clock()))
    _SHAPES[ndim].pack_into(head, at, *shape)
    at += 8 * ndim
    head[at : at + len(key)] = key
    return head


def _checksum_hasher(head: Buffer, authenticated: bool, rt: _Runtime) -> Any:
    """An XXH3 hasher fed with the header bytes the checksum covers (all but the tags)."""
    view = memoryview(head)
    checksum = rt.xxh3_128(view[:_DIGEST_AT])
    checksum.update(view[_ID_AT if authenticated else _FIXED_SIZE :])
    return checksum


class _Mac:
    """An entry's MAC under construction: feed it the payload, then take `digest`.

    The payload is hashed on its own from its first byte, which keeps BLAKE3 on its widest
    SIMD path (hashing it after the header bytes in one stream ran at half the speed); the
    keyed hash then covers the header bytes and that 32-byte payload hash.
    """

    __slots__ = ("_head", "_payload", "_secret")

    def __init__(self, secret: EntrySecret, head: Buffer) -> None:
        import blake3

        self._secret = secret
        self._head = memoryview(head)
        self._payload = blake3.blake3()

    def update(self, payload: Buffer) -> None:
        self._payload.update(payload)

    def digest(self) -> bytes:
        """The MAC; call once, after the whole payload (and, when sealing, once the
        header's checksum is in place: the MAC covers it)."""
        outer = self._secret.hasher()
        outer.update(self._head[:_MAC_AT])
        outer.update(self._head[_ID_AT:])
        outer.update(self._payload.digest())
        return outer.digest()


def _seal(
    head: bytearray,
    parts: Sequence[Buffer],
    secret: EntrySecret | None,
    rt: _Runtime,
    copy_to: memoryview | None = None,
) -> None:
    """Fill in the checksum and then (when signing) the MAC of `head` followed by the
    payload, which is `parts` joined; with `copy_to`, also copy the payload there, chunk
    by chunk, hashing each chunk of `parts` (the bytes that are sealed) while it is in cache.
    """
    view = memoryview(head)
    checksum = _checksum_hasher(view, secret is not None, rt)
    mac = None if secret is None else _Mac(secret, view)
    at = 0
    for part in parts:
        source = _byte_view(part)
        for start in range(0, source.nbytes, _CHUNK):
            chunk = source[start : start + _CHUNK]
            if copy_to is not None:
                copy_to[at : at + chunk.nbytes] = chunk
                at += chunk.nbytes
            checksum.update(chunk)
            if mac is not None:
                mac.update(chunk)
    view[_DIGEST_AT:_FIXED_SIZE] = checksum.digest()
    if mac is not None:
        view[_MAC_AT:_ID_AT] = mac.digest()


def entry_size(key: str, tensor: torch.Tensor, *, keyring: EntryKeyring | None = None) -> int:
    """Bytes `encode_entry` writes for ``tensor`` under ``key``: header plus payload."""
    import torch

    value: object = tensor
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"embeddings must be torch.Tensor, got {type(value).__name__}")
    flags = 0 if _signer(keyring) is None else _SIGNED_FLAGS
    head = _header_size(tensor.dim(), len(_key_bytes(key)), flags)
    return head + tensor.numel() * tensor.element_size()


def largest_entry_size(key: str, payload_bytes: int, ndim: int) -> int:
    """The most bytes a genuine entry under ``key`` with a payload of ``payload_bytes`` and
    ``ndim`` dimensions can have (the largest header any writer makes for it, plus the
    payload): a reader with a target of that size need not fetch anything larger."""
    return _header_size(ndim, len(_key_bytes(key)), _SIGNED_FLAGS) + payload_bytes


def encode_entry(key: str, tensor: torch.Tensor, *, keyring: EntryKeyring | None = None) -> bytes:
    """The entry of ``tensor`` stored under key text ``key`` (see the module doc for the layout).

    Any strided tensor of a `DTYPE_CODES` dtype on any device; it is copied, never kept.
    With a ``keyring``, the entry carries a MAC made with its current secret.
    """
    rt = _rt()
    raw_key = _key_bytes(key)
    secret = _signer(keyring)
    t, code = _plain_cpu(tensor, rt)
    nbytes = t.numel() * t.element_size()
    head = _header(raw_key, tuple(t.shape), code, nbytes, secret)
    payload = rt.memory_view(t.data_ptr(), nbytes, _PyBUF_READ) if nbytes else b""
    _seal(head, (payload,), secret, rt)
    return b"".join((head, payload))


def encode_entry_into(
    buf: Buffer, key: str, tensor: torch.Tensor, *, keyring: EntryKeyring | None = None
) -> int:
    """Write the entry of ``tensor`` at the start of the writable buffer ``buf``; bytes written.

    For registered (pinned) memory: size the region with `entry_size` (same ``keyring``).
    The checksum and MAC are made over ``tensor``'s own bytes as they are copied, never over
    what ``buf`` holds afterwards: bytes written into ``buf`` by anyone else meanwhile make the
    entry fail to verify. Raises `ValueError` when ``buf`` is read-only or too small; the
    bytes after the entry are left untouched.
    """
    rt = _rt()
    raw_key = _key_bytes(key)
    secret = _signer(keyring)
    t, code = _plain_cpu(tensor, rt)
    nbytes = t.numel() * t.element_size()
    head = _header(raw_key, tuple(t.shape), code, nbytes, secret)
    out = _byte_view(buf)
    total = len(head) + nbytes
    if out.readonly:
        raise ValueError("encode_entry_into() needs a writable buffer (bytearray, memoryview)")
    if out.nbytes < total:
        raise ValueError(f"buffer holds {out.nbytes} bytes, the entry needs {total}")
    source = rt.memory_view(t.data_ptr(), nbytes, _PyBUF_READ) if nbytes else b""
    _seal(head, (source,), secret, rt, copy_to=out[len(head) : total])
    out[: len(head)] = head
    return total


def entry_header(
    key: str, payload: torch.Tensor | Sequence[torch.Tensor], *, keyring: EntryKeyring | None = None
) -> bytes:
    """The header of the entry whose payload lies in ``payload``: one tensor, or several
    (e.g. pages of a pool) that make the embedding when concatenated along the first
    dimension, each a contiguous CPU tensor, none copied.

    The header followed by the tensors' bytes, in order, is the entry `encode_entry` makes
    of their concatenation, checksum and (with a ``keyring``) MAC included: a store can write
    the header and the tensors' memory as one object without joining them first. The
    tensors must not change until that write is done, or the entry fails to verify.
    """
    rt = _rt()
    raw_key = _key_bytes(key)
    secret = _signer(keyring)
    runs = _runs(payload, rt, "entry_header", "payload")
    nbytes = [t.numel() * t.element_size() for t in runs.tensors]
    head = _header(raw_key, runs.shape, rt.code_of[runs.dtype], sum(nbytes), secret)
    parts = [
        rt.memory_view(t.data_ptr(), n, _PyBUF_READ) for t, n in zip(runs.tensors, nbytes, strict=True) if n
    ]
    _seal(head, parts, secret, rt)
    return bytes(head)


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
    flags: int
    header: bytes
    """A private copy of the header: every field above was read from it."""

    @property
    def authenticated(self) -> bool:
        return bool(self.flags & FLAG_AUTHENTICATED)

    @property
    def issued_at(self) -> int | None:
        if not self.flags & FLAG_ISSUED_AT:
            return None
        value: int = _U64.unpack_from(self.header, _AUTH_END)[0]
        return value


def _private_header(view: memoryview) -> bytes:
    """The header bytes of entry `view`, copied once (so the fields parsed and the bytes
    hashed are the same, whatever happens to `view` meanwhile)."""
    size = view.nbytes
    if size < _FIXED_SIZE:
        raise CorruptEntry(f"truncated entry: {size} bytes, a header needs at least {_FIXED_SIZE}")
    head = view[10] | view[11] << 8
    return view[: min(max(head, _FIXED_SIZE), size)].tobytes()


def _parse(header: bytes, size: int, rt: _Runtime) -> _Parsed:
    """The fields of the entry of `size` bytes whose header is `header` (a private copy),
    checked for consistency (not the checksum)."""
    magic, version, code, ndim, flags, key_len, head, reserved, payload, _ = _FIXED.unpack_from(header)
    if magic != MAGIC:
        raise CorruptEntry(f"not an mmkey entry: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"entry format version {version}, this mmkey reads {FORMAT_VERSION}")
    if flags not in _FLAG_SETS or reserved:
        raise CorruptEntry(
            f"entry flags {flags:#x} / reserved {reserved:#x}: flags must be 0, "
            f"{FLAG_AUTHENTICATED:#x} or {_SIGNED_FLAGS:#x} and reserved must be 0"
        )
    dtype = rt.dtype_of.get(code)
    if dtype is None:
        raise CorruptEntry(f"entry dtype code {code} is unknown to this mmkey and torch")
    if ndim > MAX_NDIM or key_len == 0 or head != _header_size(ndim, key_len, flags):
        raise CorruptEntry(f"entry header length {head} does not fit ndim {ndim} and key length {key_len}")
    if size != head + payload:
        what = "truncated" if size < head + payload else "extended"
        raise CorruptEntry(f"{what} entry: {size} bytes, the header says {head + payload}")
    at = _shape_at(flags)
    shape: tuple[int, ...] = _SHAPES[ndim].unpack_from(header, at)
    numel = math.prod(shape)
    if numel * dtype.itemsize != payload or (not numel and any(dim >> 62 for dim in shape)):
        raise CorruptEntry(f"entry shape {shape} of {dtype} does not fit {payload} payload bytes")
    at += 8 * ndim
    return _Parsed(dtype, shape, head, payload, header[at : at + key_len], flags, header)


def _parse_as(
    view: memoryview, key: str, raw_key: bytes, rt: _Runtime, keyring: EntryKeyring | None
) -> _Parsed:
    """`_parse` of a private copy of the header, and `CorruptEntry` unless the entry was
    written under ``key``; under a ``keyring`` every refusal is a `ForgedEntry`."""
    try:
        parsed = _parse(_private_header(view), view.nbytes, rt)
        if parsed.stored_key != raw_key:
            raise CorruptEntry(
                f"entry was written under key {parsed.stored_key[:120].decode('latin-1')!r}, "
                f"read as {key[:120]!r}"
            )
    except CorruptEntry as exc:
        if keyring is None:
            raise
        raise ForgedEntry(str(exc), reason="bad_mac") from None
    return parsed


def peek_header(data: Buffer) -> EntryHeader:
    """Read an entry's header without verifying its checksum; `CorruptEntry` if malformed.

    For routing and sizing only: the tensor itself comes from `decode_entry`, which verifies.
    """
    view = _byte_view(data)
    parsed = _parse(_private_header(view), view.nbytes, _rt())
    key = parsed.stored_key.decode("latin-1")
    key_id = parsed.header[_ID_AT:_AUTH_END] if parsed.authenticated else None
    return EntryHeader(
        key,
        parsed.dtype,
        parsed.shape,
        parsed.header_size,
        parsed.payload_size,
        key_id,
        parsed.issued_at,
    )


def decode_entry(
    key: str, data: Buffer, *, copy: bool = True, keyring: EntryKeyring | None = None
) -> torch.Tensor:
    """The tensor stored in entry ``data``, verified against key text ``key``.

    Raises `CorruptEntry` (saying what failed) unless magic, version, dtype, shape, sizes,
    the key and the checksum all verify. With a ``keyring``, the entry must instead carry a
    MAC that verifies under one of its secrets (compared in constant time) that has not
    expired, else `ForgedEntry` (with its ``reason``); an entry without a MAC is served only
    in the keyring's migration window. Every refusal under a keyring is a `ForgedEntry`.
    Without a keyring, authenticated entries are served after their checksum like any
    other (such a reader cannot check a MAC, and refusing them would gain it nothing).

    The result is a new tensor holding exactly the bytes that verified, copied out of
    ``data`` as they were hashed. With ``copy=False`` it is a view of ``data`` instead, which
    must be writable, owned by the caller, written by nobody else and left unchanged while
    the tensor lives (never memory registered with a transfer engine).
    """
    if copy:
        return verify_entry(key, data, keyring=keyring)[0]
    rt = _runtime or _rt()
    raw_key = _key_bytes(key)
    view = _byte_view(data)
    parsed = _parse_as(view, key, raw_key, rt, keyring)
    verifier, expected, secret = _verifier(parsed, key, keyring)
    verifier.update(view[parsed.header_size :])
    _verify(verifier.digest(), expected, key, secret, keyring)
    if view.readonly:
        raise ValueError("decode_entry(copy=False) needs a writable buffer it may alias")
    import torch

    dtype, payload = parsed.dtype, parsed.payload_size
    if not payload:
        return torch.empty(parsed.shape, dtype=dtype)
    tensor = torch.frombuffer(view, dtype=dtype, count=payload // dtype.itemsize, offset=parsed.header_size)
    return tensor.view(parsed.shape)


def verify_entry(key: str, data: Buffer, *, keyring: EntryKeyring | None = None) -> tuple[torch.Tensor, bool]:
    """`decode_entry` (copying), and whether the entry was served without a MAC under
    ``keyring`` (its migration window); for caches that count those."""
    rt = _runtime or _rt()
    raw_key = _key_bytes(key)
    view = _byte_view(data)
    parsed = _parse_as(view, key, raw_key, rt, keyring)
    verifier, expected, secret = _verifier(parsed, key, keyring)
    out = rt.blank[parsed.dtype].new_empty(parsed.shape)
    if parsed.payload_size:
        target = rt.memory_view(out.data_ptr(), parsed.payload_size, _PyBUF_WRITE)
        _copy_hashing(target, view[parsed.header_size :], verifier)
    _verify(verifier.digest(), expected, key, secret, keyring)
    return out, keyring is not None and secret is None


_SCRATCH_KEPT = 64 << 20
"""Scratch memory up to this size is kept per thread for the next read."""
_scratch_of = threading.local()


def _scratch(nbytes: int, rt: _Runtime) -> torch.Tensor:
    """Private bytes (at least `nbytes`) for verifying an entry before it goes to caller
    memory: this thread's buffer, reused while it fits (no fresh pages to fault in)."""
    kept: torch.Tensor | None = getattr(_scratch_of, "buffer", None)
    if kept is not None and kept.numel() >= nbytes:
        return kept
    import torch

    buffer = rt.blank[torch.uint8].new_empty(max(nbytes, 1))
    if nbytes <= _SCRATCH_KEPT:
        _scratch_of.buffer = buffer
    return buffer


def _copy_hashing(target: memoryview, source: memoryview, hasher: Any) -> None:
    """Copy `source` into `target` chunk by chunk, hashing each chunk of the copy while it
    is in cache: the hash covers exactly the bytes `target` ends up with."""
    for start in range(0, source.nbytes, _CHUNK):
        chunk = target[start : start + _CHUNK]
        chunk[:] = source[start : start + _CHUNK]
        hasher.update(chunk)


def _verifier(
    parsed: _Parsed, key: str, keyring: EntryKeyring | None
) -> tuple[Any, bytes, EntrySecret | None]:
    """The hasher to feed the payload to, the tag it must produce and the secret (None
    for the checksum); raises `ForgedEntry` when ``keyring`` refuses the entry outright."""
    rt = _runtime or _rt()
    header = parsed.header
    checksum = _checksum_hasher(header, parsed.authenticated, rt), header[_DIGEST_AT:_FIXED_SIZE]
    if keyring is None:
        return (*checksum, None)
    _signer(keyring)  # the type check
    if not parsed.authenticated:
        if keyring.serves_unsigned():
            return (*checksum, None)
        raise ForgedEntry(
            f"entry for key {key[:120]!r} carries no MAC, and this keyring accepts only "
            "authenticated entries (MMKEY_ENTRY_AUTH=migrate with MMKEY_ENTRY_MIGRATE_UNTIL, "
            "or migrate_until, opens a migration window)",
            reason="unsigned",
        )
    key_id = header[_ID_AT:_AUTH_END]
    secret = keyring.secret_for(key_id)
    if secret is None:
        held = ", ".join(s.key_id.hex() for s in (keyring.current, *keyring.previous))
        raise ForgedEntry(
            f"entry for key {key[:120]!r} names secret {key_id.hex()}, which this keyring "
            f"does not hold (it holds {held}; keep a rotated-out secret in previous, with a "
            "not-after time, while its entries live)",
            reason="unknown_key",
        )
    issued = parsed.issued_at
    if secret.not_after is not None and (
        secret.expired(time.time()) or (issued is not None and issued > secret.not_after.timestamp())
    ):
        raise ForgedEntry(
            f"entry for key {key[:120]!r} was made with secret {key_id.hex()}, which expired "
            f"at {secret.not_after.isoformat()}",
            reason="expired",
        )
    return _Mac(secret, header), header[_MAC_AT:_ID_AT], secret


def decode_entry_into(
    key: str,
    data: Buffer,
    out: torch.Tensor | Sequence[torch.Tensor],
    *,
    keyring: EntryKeyring | None = None,
) -> None:
    """Verify entry ``data`` against key text ``key`` as `decode_entry` does, then copy its
    payload into ``out``: one tensor of the entry's dtype and shape, or several (e.g. pages
    of a pool) whose concatenation along the first dimension has it.

    Every target must be a contiguous CPU tensor. Raises `CorruptEntry` (or `ForgedEntry`)
    like `decode_entry`, and `CorruptEntry` when a verified entry holds another dtype or
    shape than the targets take; the targets are written only once the entry has
    verified, with exactly the bytes that verified (copied into private memory as they
    were hashed, then into the targets).
    """
    verify_entry_into(key, data, out, keyring=keyring)


def verify_entry_into(
    key: str,
    data: Buffer,
    out: torch.Tensor | Sequence[torch.Tensor],
    *,
    keyring: EntryKeyring | None = None,
) -> bool:
    """`decode_entry_into`, returning whether the entry was served without a MAC under
    ``keyring`` (its migration window)."""
    rt = _runtime or _rt()
    raw_key = _key_bytes(key)
    targets = _runs(out, rt, "decode_entry_into", "targets")
    view = _byte_view(data)
    parsed = _parse_as(view, key, raw_key, rt, keyring)
    verifier, expected, secret = _verifier(parsed, key, keyring)
    payload = parsed.payload_size
    scratch = _scratch(payload, rt)
    if payload:
        private = rt.memory_view(scratch.data_ptr(), payload, _PyBUF_WRITE)
        _copy_hashing(private, view[parsed.header_size :], verifier)
    _verify(verifier.digest(), expected, key, secret, keyring)
    if parsed.dtype != targets.dtype or parsed.shape != targets.shape:
        raise CorruptEntry(
            f"entry for key {key[:120]!r} holds {parsed.dtype} {parsed.shape}, the targets "
            f"take {targets.dtype} {targets.shape}"
        )
    if payload:
        at = 0
        for run in targets.tensors:
            size = run.numel() * run.element_size()
            if size:
                rt.memory_view(run.data_ptr(), size, _PyBUF_WRITE)[:] = private[at : at + size]
            at += size
    return keyring is not None and secret is None


def payload_runs(value: object, function: str, what: str) -> list[torch.Tensor]:
    """`value` checked as the payload runs of one entry (a tensor, or a non-empty list of
    contiguous CPU tensors of one dtype and trailing shape), as a list; the errors name
    `function` and `what`. For the caches that take payloads or targets in runs."""
    return _runs(value, _rt(), function, what).tensors


class _Runs(NamedTuple):
    """Tensors that together hold one entry's payload, in order."""

    tensors: list[torch.Tensor]
    dtype: torch.dtype
    shape: tuple[int, ...]
    """The shape of their concatenation along the first dimension."""


def _runs(value: object, rt: _Runtime, function: str, what: str) -> _Runs:
    """`value` (a tensor, or a non-empty sequence of tensors) checked as the contiguous CPU
    runs of one entry's payload."""
    import torch

    if isinstance(value, torch.Tensor):
        items: list[object] = [value]
    elif isinstance(value, (list, tuple)) and value:
        items = list(value)
    else:
        raise TypeError(
            f"{function}() takes its {what} as a torch.Tensor or a non-empty list of them, "
            f"got {type(value).__name__}"
        )
    tensors: list[torch.Tensor] = []
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"{function}() {what} must be torch.Tensor, got {type(item).__name__}")
        if item.layout != torch.strided:
            raise TypeError(
                f"{function}() {what} must be dense tensors, got layout {item.layout}; call .to_dense() first"
            )
        if item.device.type != "cpu" or not item.is_contiguous() or item.is_conj() or item.is_neg():
            raise ValueError(
                f"{function}() {what} must be contiguous CPU tensors without conj/neg bits "
                f"(got {'a non-contiguous' if not item.is_contiguous() else 'a'} tensor on "
                f"{item.device}); pass rows of a contiguous host buffer"
            )
        tensors.append(item)
    first = tensors[0]
    if first.dtype not in rt.code_of:
        raise TypeError(f"cannot store dtype {first.dtype}; convert it to a standard dtype first")
    if first.dim() > MAX_NDIM:
        raise ValueError(f"cannot store a tensor with {first.dim()} dims (at most {MAX_NDIM})")
    if len(tensors) == 1:
        return _Runs(tensors, first.dtype, tuple(first.shape))
    rest = tuple(first.shape[1:])
    for t in tensors:
        if t.dtype != first.dtype or t.dim() == 0 or tuple(t.shape[1:]) != rest:
            raise ValueError(
                f"{function}() {what} must share one dtype and all but their first dimension: "
                f"got {first.dtype} {tuple(first.shape)} and {t.dtype} {tuple(t.shape)}"
            )
    return _Runs(tensors, first.dtype, (sum(t.shape[0] for t in tensors), *rest))


def _verify(
    digest: bytes,
    expected: bytes,
    key: str,
    secret: EntrySecret | None,
    keyring: EntryKeyring | None,
) -> None:
    """Raise unless `digest` is the checksum (or, with `secret`, the MAC) the entry carries;
    under a ``keyring`` the refusal is a `ForgedEntry`."""
    if secret is None:
        if digest == expected:
            return
        message = f"entry for key {key[:120]!r} fails its checksum"
        if keyring is None:
            raise CorruptEntry(message)
        raise ForgedEntry(message, reason="unsigned")
    if not hmac.compare_digest(digest, expected):
        raise ForgedEntry(
            f"entry for key {key[:120]!r} fails its MAC under secret {secret.key_id.hex()}",
            reason="bad_mac",
        )
