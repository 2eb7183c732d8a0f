"""Content digests of tensors and bytes, the same in every process and on every device.

BLAKE3 and XXH3 digest a framing of the dtype, the shape and the C-order bytes, so equal
content, dtype and shape give equal digests whatever the strides or device, and a
reshape or a dtype view gives a different one. SGLANG reproduces SGLang's CPU
``tensor_hash``: SHA-256 over the raw bytes, first 8 bytes read big-endian.
Tensors are read through a zero-copy ``uint8`` view: no ``tobytes()``, no bf16 upcast.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from typing import TYPE_CHECKING

from mmkey._tensors import byte_view, plain_cpu
from mmkey.digest import HashScheme, MMHash
from mmkey.errors import InvalidKey

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

__all__ = ["hash_bytes", "hash_tensor", "identifier_digest", "tensor_bytes"]

_TENSOR_DOMAIN = b"mmkey/tensor/v1\x00"
_BYTES_DOMAIN = b"mmkey/bytes/v1\x00"
_ID_DOMAIN = b"mmkey/id/v1\x00"
_BLAKE3_PARALLEL_FROM = 1 << 20
"""Inputs at least this large are hashed by BLAKE3 on all cores."""

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
    raise ImportError("mmkey digests are defined on little-endian machines only")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only ``uint8`` memoryview of ``t``'s C-order bytes, on the CPU.

    Zero-copy for a contiguous CPU tensor; a non-contiguous or device tensor is copied
    once (to C order, to host memory) first.
    """
    flat = plain_cpu(
        t,
        "hash",
        "expected a torch.Tensor",
        "use hash_bytes() for bytes-like data or torch.as_tensor(x) first",
    )
    return byte_view(flat)


def _frame(t: torch.Tensor, nbytes: int) -> bytes:
    dtype = str(t.dtype).removeprefix("torch.").encode("ascii")
    return b"".join(
        (
            _TENSOR_DOMAIN,
            struct.pack("<B", len(dtype)),
            dtype,
            struct.pack(f"<B{t.dim()}Q", t.dim(), *t.shape),
            struct.pack("<Q", nbytes),
        )
    )


def hash_tensor(t: torch.Tensor, scheme: HashScheme = HashScheme.BLAKE3) -> MMHash:
    """The digest of a tensor's dtype, shape and C-order bytes under ``scheme``."""
    _check_scheme(scheme)
    data = tensor_bytes(t)
    if scheme is HashScheme.SGLANG:
        return _sglang(data)
    return _digest((_frame(t, data.nbytes), data), scheme)


def hash_bytes(data: Buffer, scheme: HashScheme = HashScheme.BLAKE3) -> MMHash:
    """The digest of bytes-like ``data`` under ``scheme`` (for SGLANG, of the raw bytes)."""
    view = _as_bytes(data)
    if _check_scheme(scheme) is HashScheme.SGLANG:
        return _sglang(view)
    return _digest((_BYTES_DOMAIN + struct.pack("<Q", view.nbytes), view), scheme)


def _as_bytes(data: object) -> memoryview:
    # a tensor exists only once torch is loaded: never import it just to refuse one
    torch = sys.modules.get("torch")
    if isinstance(data, str) or (torch is not None and isinstance(data, torch.Tensor)):
        fix = "encode text first, e.g. s.encode()" if isinstance(data, str) else "use hash_tensor()"
        raise TypeError(f"hash_bytes() takes bytes-like data, got {type(data).__name__}; {fix}")
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"hash_bytes() takes bytes-like data (bytes, bytearray, memoryview), "
            f"got {type(data).__name__}; use hash_tensor() for tensors"
        ) from None
    if view.c_contiguous:
        return view.cast("B") if view.format != "B" or view.ndim != 1 else view
    return memoryview(view.tobytes())


def identifier_digest(identifier: str) -> MMHash:
    """The `HashScheme.ID` digest of a serving stack's opaque identifier text.

    BLAKE3-128 over a domain tag and the identifier's UTF-8 bytes: distinct texts give
    distinct digests (to BLAKE3's collision resistance), the same text the same digest
    in every process. Raises `TypeError` for non-text and `InvalidKey` for empty text
    or text with lone surrogates.
    """
    value: object = identifier
    if not isinstance(value, str):
        fix = "decode bytes first, e.g. b.decode()" if isinstance(value, bytes) else "pass str(x)"
        raise TypeError(f"identifier_digest() takes text, got {type(value).__name__}; {fix}")
    if not identifier:
        raise InvalidKey("an identifier must not be empty; pass the stack's own id text")
    try:
        raw = identifier.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKey(
            f"identifier {identifier!r} is not valid Unicode text ({exc.reason}); "
            "remove lone surrogates, e.g. decode the source bytes with errors='replace'"
        ) from None
    import blake3

    return MMHash(int.from_bytes(blake3.blake3(_ID_DOMAIN + raw).digest(16), "big"))


def _check_scheme(scheme: object) -> HashScheme:
    if not isinstance(scheme, HashScheme):
        raise TypeError(f"scheme must be a HashScheme member, got {scheme!r}")
    if not scheme.hashes_content:
        raise ValueError(
            f"{scheme} digests identifier text, not content; use identifier_digest(text), "
            "or a content scheme (BLAKE3, XXH3, SGLANG) to hash tensors and bytes"
        )
    return scheme


def _digest(parts: tuple[bytes, memoryview], scheme: HashScheme) -> MMHash:
    header, data = parts
    if scheme is HashScheme.XXH3:
        import xxhash

        x = xxhash.xxh3_128(header)
        x.update(data)
        return MMHash(x.intdigest())
    import blake3

    threads = blake3.blake3.AUTO if data.nbytes >= _BLAKE3_PARALLEL_FROM else 1
    b = blake3.blake3(header, max_threads=threads)
    b.update(data)
    return MMHash(int.from_bytes(b.digest(16), "big"))


def _sglang(data: memoryview) -> MMHash:
    return MMHash(int.from_bytes(hashlib.sha256(data).digest()[:8], "big"))
