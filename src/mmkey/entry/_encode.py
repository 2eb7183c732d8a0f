"""Writing entries: the header of a tensor (or of payload runs) under a key, sealed with its
checksum and, given a keyring, its MAC."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mmkey._tensors import byte_view, plain_cpu
from mmkey.entry._format import (
    _AUTH_END,
    _CHUNK,
    _DIGEST_AT,
    _FIXED,
    _FIXED_SIZE,
    _ID_AT,
    _MAC_AT,
    _SHAPES,
    _SIGNED_FLAGS,
    _U64,
    FORMAT_VERSION,
    MAGIC,
    MAX_NDIM,
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

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

    from mmkey.entry.auth import EntryKeyring, EntrySecret

_clock: Callable[[], float] = time.time
"""Where signed entries take their issue time from."""


def _plain_cpu(tensor: torch.Tensor, rt: _Runtime) -> tuple[torch.Tensor, int]:
    """``tensor`` as a contiguous CPU tensor without conj/neg bits, and its dtype code."""
    t = plain_cpu(tensor, "store", "embeddings must be torch.Tensor", "convert with torch.as_tensor(x)")
    code = rt.code_of.get(t.dtype)
    if code is None:
        raise TypeError(f"cannot store dtype {t.dtype}; convert it to a standard dtype first")
    if t.dim() > MAX_NDIM:
        raise ValueError(f"cannot store a tensor with {t.dim()} dims (at most {MAX_NDIM})")
    return t, code


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
    payload = byte_view(t) if nbytes else b""
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
    source = byte_view(t) if nbytes else b""
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
    parts = [byte_view(t) for t, n in zip(runs.tensors, nbytes, strict=True) if n]
    _seal(head, parts, secret, rt)
    return bytes(head)
