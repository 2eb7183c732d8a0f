"""Reading entries: `verify`, the one read, checks an entry against the key it is read under
(and, given a keyring, its MAC) and returns its tensor or writes it into the caller's; the
bytes it returns are the bytes that verified."""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, overload

from mmkey._tensors import byte_view
from mmkey.entry._format import (
    _AUTH_END,
    _CHUNK,
    _DIGEST_AT,
    _FIXED,
    _FIXED_SIZE,
    _FLAG_SETS,
    _ID_AT,
    _MAC_AT,
    _SHAPES,
    _SIGNED_FLAGS,
    _U64,
    FLAG_AUTHENTICATED,
    FLAG_ISSUED_AT,
    FORMAT_VERSION,
    MAGIC,
    MAX_NDIM,
    EntryHeader,
    _byte_view,
    _checksum_hasher,
    _header_size,
    _key_bytes,
    _Mac,
    _rt,
    _runs,
    _Runtime,
    _shape_at,
    _signer,
)
from mmkey.errors import CorruptEntry, ForgedEntry

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

    from mmkey.entry.auth import EntryKeyring, EntrySecret


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


@overload
def verify(
    key: str,
    data: Buffer,
    into: None = None,
    *,
    keyring: EntryKeyring | None = None,
    copy: bool = True,
) -> tuple[torch.Tensor, bool]: ...
@overload
def verify(
    key: str,
    data: Buffer,
    into: torch.Tensor | Sequence[torch.Tensor],
    *,
    keyring: EntryKeyring | None = None,
) -> tuple[None, bool]: ...
def verify(
    key: str,
    data: Buffer,
    into: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    keyring: EntryKeyring | None = None,
    copy: bool = True,
) -> tuple[torch.Tensor | None, bool]:
    """The tensor stored in entry ``data``, verified against key text ``key``, and whether it
    was served without a MAC under ``keyring`` (its migration window; for caches that count
    those). With ``into``, the payload is written there instead and the tensor is ``None``.

    Raises `CorruptEntry` (saying what failed) unless magic, version, dtype, shape, sizes,
    the key and the checksum all verify. With a ``keyring``, the entry must instead carry a
    MAC that verifies under one of its secrets (compared in constant time) that has not
    expired, else `ForgedEntry` (with its ``reason``); an entry without a MAC is served only
    in the keyring's migration window. Every refusal under a keyring is a `ForgedEntry`.
    Without a keyring, authenticated entries are served after their checksum like any
    other (such a reader cannot check a MAC, and refusing them would gain it nothing).

    The tensor is a new one holding exactly the bytes that verified, copied out of ``data``
    as they were hashed. With ``copy=False`` it is a view of ``data`` instead, which must be
    writable, owned by the caller, written by nobody else and left unchanged while the
    tensor lives (never memory registered with a transfer engine).

    ``into`` is one tensor of the entry's dtype and shape, or several (e.g. pages of a pool)
    whose concatenation along the first dimension has it, each a contiguous CPU tensor;
    `CorruptEntry` when a verified entry holds another dtype or shape than they take. They
    are written only once the entry has verified, with exactly the bytes that verified
    (copied into private memory as they were hashed, then into the targets).
    """
    if into is not None and not copy:
        raise ValueError("verify() copies into its targets: leave copy=True with into")
    return _read(key, data, into, keyring, copy, None if into is None else ("verify", "into"))


def _read(
    key: str,
    data: Buffer,
    into: object,
    keyring: EntryKeyring | None,
    copy: bool,
    targets_of: tuple[str, str] | None,
) -> tuple[torch.Tensor | None, bool]:
    """`verify`; `into` is the targets when `targets_of` is given (the function and the
    argument its errors name), else ignored."""
    rt = _rt()
    raw_key = _key_bytes(key)
    targets = None if targets_of is None else _runs(into, rt, *targets_of)
    view = _byte_view(data)
    parsed = _parse_as(view, key, raw_key, rt, keyring)
    verifier, expected, secret = _verifier(parsed, key, keyring)
    unsigned = keyring is not None and secret is None
    payload = parsed.payload_size
    if targets is not None:
        private = byte_view(_scratch(payload, rt), writable=True)[:payload]
        _copy_hashing(private, view[parsed.header_size :], verifier)
        _check_tag(verifier.digest(), expected, key, secret, keyring)
        if parsed.dtype != targets.dtype or parsed.shape != targets.shape:
            raise CorruptEntry(
                f"entry for key {key[:120]!r} holds {parsed.dtype} {parsed.shape}, the targets "
                f"take {targets.dtype} {targets.shape}"
            )
        at = 0
        for run in targets.tensors:
            size = run.numel() * run.element_size()
            if size:
                byte_view(run, writable=True)[:] = private[at : at + size]
            at += size
        return None, unsigned
    if copy:
        if not payload:
            _check_tag(verifier.digest(), expected, key, secret, keyring)
            return rt.blank[parsed.dtype].new_empty(parsed.shape), unsigned
        source = view[parsed.header_size :]
        if payload > _CHUNK:  # copied and hashed a chunk at a time, while it is in cache
            out = rt.blank[parsed.dtype].new_empty(parsed.shape)
            _copy_hashing(byte_view(out, writable=True), source, verifier)
            _check_tag(verifier.digest(), expected, key, secret, keyring)
            return out, unsigned
        copied = bytearray(source)  # one copy (cheaper than a tensor's byte view when small)
        verifier.update(copied)
        _check_tag(verifier.digest(), expected, key, secret, keyring)
        import torch

        tensor = torch.frombuffer(copied, dtype=parsed.dtype, count=payload // parsed.dtype.itemsize)
        return tensor.view(parsed.shape), unsigned
    verifier.update(view[parsed.header_size :])
    _check_tag(verifier.digest(), expected, key, secret, keyring)
    if view.readonly:
        raise ValueError("verify(copy=False) needs a writable buffer it may alias")
    import torch

    if not payload:
        return torch.empty(parsed.shape, dtype=parsed.dtype), unsigned
    count = payload // parsed.dtype.itemsize
    tensor = torch.frombuffer(view, dtype=parsed.dtype, count=count, offset=parsed.header_size)
    return tensor.view(parsed.shape), unsigned


def decode_entry(
    key: str, data: Buffer, *, copy: bool = True, keyring: EntryKeyring | None = None
) -> torch.Tensor:
    """Deprecated alias: ``verify(key, data, keyring=keyring, copy=copy)[0]``."""
    return verify(key, data, keyring=keyring, copy=copy)[0]


def verify_entry(key: str, data: Buffer, *, keyring: EntryKeyring | None = None) -> tuple[torch.Tensor, bool]:
    """Deprecated alias: ``verify(key, data, keyring=keyring)``."""
    return verify(key, data, keyring=keyring)


def decode_entry_into(
    key: str, data: Buffer, out: torch.Tensor | Sequence[torch.Tensor], *, keyring: EntryKeyring | None = None
) -> None:
    """Deprecated alias: ``verify(key, data, out, keyring=keyring)``, returning nothing."""
    _read(key, data, out, keyring, True, ("decode_entry_into", "targets"))


def verify_entry_into(
    key: str, data: Buffer, out: torch.Tensor | Sequence[torch.Tensor], *, keyring: EntryKeyring | None = None
) -> bool:
    """Deprecated alias: ``verify(key, data, out, keyring=keyring)[1]``."""
    return _read(key, data, out, keyring, True, ("decode_entry_into", "targets"))[1]


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
    rt = _rt()
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


def _check_tag(
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
