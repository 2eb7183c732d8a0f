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

An entry is exactly ``H + P`` bytes. `verify`, the one read, checks every field and the
checksum against the key being read, so truncated, extended, bit-flipped or re-keyed entries
raise `CorruptEntry`; the checksum detects accidents, not forgeries. Forgeries are what the
MAC stops: given an `EntryKeyring` (`mmkey.entry.auth`), `encode_entry` signs entries with its
current secret and `verify` serves only entries whose MAC verifies under one of its
secrets that has not expired, raising `ForgedEntry` otherwise (every refusal under a
keyring is a `ForgedEntry`, with a ``reason``). A reader without a keyring decodes
authenticated entries after their checksum.

Readers verify what they return, not what they saw: the header is copied out of ``data``
first and parsed from that copy, and the payload is verified while it is copied, chunk by
chunk, into memory the caller gets (or private scratch memory): bytes that change in
``data`` meanwhile (memory registered with a transfer engine is writable from the network)
can make an entry fail, never make a tensor differ from the bytes that verified. torch,
xxhash and blake3 load on first use, never at ``import mmkey``.

This module is the public face of three: ``_format`` (the layout and the tags), ``_encode``
(writing) and ``_verify`` (reading). ``decode_entry``, ``decode_entry_into``, ``verify_entry``
and ``verify_entry_into`` are deprecated aliases of `verify`.
"""

from __future__ import annotations

from mmkey.entry._encode import encode_entry, encode_entry_into, entry_header, entry_size, largest_entry_size
from mmkey.entry._format import (
    DTYPE_CODES,
    FLAG_AUTHENTICATED,
    FLAG_ISSUED_AT,
    FORMAT_VERSION,
    HEADER_ALIGN,
    MAGIC,
    EntryHeader,
)
from mmkey.entry._format import MAX_NDIM as MAX_NDIM
from mmkey.entry._format import payload_runs as payload_runs  # for the caches, not in __all__
from mmkey.entry._verify import (
    decode_entry,
    decode_entry_into,
    peek_header,
    verify,
    verify_entry,
    verify_entry_into,
)

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
    "verify",
    "verify_entry",
    "verify_entry_into",
]
