"""Entry format v1's layout (see `mmkey.entry.codec`): its constants, the header's fields
and sizes, the checks of keys and payload runs, and the tags (checksum, MAC) that writing
and reading both compute."""

from __future__ import annotations

import struct
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs

from mmkey.entry.auth import EntryKeyring
from mmkey.errors import InvalidKey

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

    from mmkey.entry.auth import EntrySecret

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
_CHUNK = 256 << 10
"""Payload bytes copied and then hashed at a time, while the copy is still in cache."""
_MAX_KEY_BYTES = 8192  # the longest v1 key is ~3.1 KB; the header length must fit a u16
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


def _header_size(ndim: int, key_len: int, flags: int) -> int:
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
