"""Readers verify what they return, and writers sign what they were given: bytes that change
in the entry buffer (memory registered with a transfer engine, which strangers can write)
while the codec works never reach a caller.

Each test changes the buffer at the worst moment, from inside the hashing, as a remote write
landing then would: right after a chunk was hashed (a reader that verified in place and
then copied would return the new bytes), or before the hash (a writer that copied and then
hashed the copy would sign the new bytes).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import mmkey.entry._format as codec_format
import mmkey.entry._verify as codec_verify
from mmkey import CorruptEntry, EntryKeyring, ForgedEntry
from mmkey.entry.codec import (
    decode_entry,
    decode_entry_into,
    encode_entry,
    encode_entry_into,
    entry_size,
    peek_header,
    verify_entry,
)

KEY = "mmk1@qwen2-vl-7b@image@blake3@000000000000000000000000000000b1"
RING = EntryKeyring.from_secrets(hashlib.sha256(b"private bytes tests").digest())
STRANGER = 0x5A
SIZES = [16, codec_format._CHUNK // 4, codec_format._CHUNK + 4096, 3 * codec_format._CHUNK]
"""Payload floats: less than a chunk, one chunk, more than one, several."""


def genuine(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


@pytest.fixture
def on_hash(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Callable[[], None]]]:
    """Hooks run on every payload hash update of the MAC, before (index 0) or after (1) it."""
    hooks: list[Callable[[], None]] = [lambda: None, lambda: None]
    real = codec_format._Mac.update

    def update(self: Any, payload: Any) -> None:
        hooks[0]()
        real(self, payload)
        hooks[1]()

    monkeypatch.setattr(codec_format._Mac, "update", update)
    yield hooks


def overwrite_from(data: bytearray, start: int) -> None:
    """The stranger's bytes over `data` from `start` on."""
    data[start:] = bytes([STRANGER]) * (len(data) - start)


@pytest.mark.parametrize("n", SIZES)
def test_bytes_written_after_they_were_hashed_are_never_returned(
    n: int, on_hash: list[Callable[[], None]]
) -> None:
    want = genuine(n)
    entry = encode_entry(KEY, want, keyring=RING)
    head = peek_header(entry).header_size
    reads: list[Callable[[bytearray], torch.Tensor]] = [
        lambda data: decode_entry(KEY, data, keyring=RING),
        lambda data: verify_entry(KEY, data, keyring=RING)[0],
        into,
    ]
    for read in reads:
        data = bytearray(entry)
        on_hash[1] = functools.partial(overwrite_from, data, head)
        try:
            got = read(data)
        except ForgedEntry:
            continue  # a later chunk held the stranger's bytes: refused
        finally:
            on_hash[1] = lambda: None
        assert torch.equal(got, want)  # exactly what was hashed, never the new bytes


def into(data: bytearray) -> torch.Tensor:
    n = (len(data) - peek_header(data).header_size) // 4
    target = torch.full((n,), -1.0)
    decode_entry_into(KEY, data, target, keyring=RING)
    return target


@pytest.mark.parametrize("n", SIZES)
def test_targets_stay_untouched_when_the_stranger_wins(n: int, on_hash: list[Callable[[], None]]) -> None:
    entry = bytearray(encode_entry(KEY, genuine(n), keyring=RING))
    head = peek_header(entry).header_size
    # write before the first hash: every chunk copied afterwards is the stranger's
    on_hash[0] = lambda: entry.__setitem__(slice(head, None), bytes([STRANGER]) * (len(entry) - head))
    target = torch.full((n,), -1.0)
    try:
        decode_entry_into(KEY, entry, target, keyring=RING)
    except ForgedEntry:
        assert bool((target == -1.0).all())
    else:  # one chunk: copied before the stranger wrote, and that copy is what was hashed
        assert n * 4 <= codec_format._CHUNK and torch.equal(target, genuine(n))


@pytest.mark.parametrize("n", SIZES)
def test_a_writer_signs_the_callers_bytes_not_what_the_buffer_holds(
    n: int, on_hash: list[Callable[[], None]]
) -> None:
    want = genuine(n)
    buf = bytearray(entry_size(KEY, want, keyring=RING))

    head = len(buf) - n * 4

    def stranger_writes() -> None:
        buf[head:] = bytes([STRANGER]) * (len(buf) - head)  # the payload in the buffer

    on_hash[0] = stranger_writes  # lands after the copy, before the hash
    encode_entry_into(buf, KEY, want, keyring=RING)
    on_hash[0] = lambda: None
    with pytest.raises(ForgedEntry):
        decode_entry(KEY, buf, keyring=RING)  # the stranger's bytes were never signed
    clean = bytearray(len(buf))
    encode_entry_into(clean, KEY, want, keyring=RING)
    assert torch.equal(decode_entry(KEY, clean, keyring=RING), want)  # the control


def test_the_header_is_read_once_from_a_private_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape changed in the buffer after the header was parsed never shapes the result."""
    want = genuine(64).reshape(8, 8)
    entry = bytearray(encode_entry(KEY, want, keyring=RING))
    real = codec_verify._parse

    def parse_then_rewrite(header: bytes, size: int, rt: Any) -> Any:
        parsed = real(header, size, rt)
        entry[88:104] = (b"\x10" + bytes(7)) + (b"\x04" + bytes(7))  # shape (16, 4) in the buffer
        return parsed

    monkeypatch.setattr(codec_verify, "_parse", parse_then_rewrite)
    got = decode_entry(KEY, entry, keyring=RING)
    assert got.shape == (8, 8) and torch.equal(got, want)


def test_without_a_keyring_changed_bytes_are_corrupt_never_served(
    on_hash: list[Callable[[], None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checksum path copies before it hashes too."""
    want = genuine(codec_format._CHUNK)
    entry = bytearray(encode_entry(KEY, want))
    head = peek_header(entry).header_size
    hashed: list[int] = []
    real = codec_verify._copy_hashing

    def copy_hashing(target: memoryview, source: memoryview, hasher: Any) -> None:
        class Spy:
            def update(self, chunk: memoryview) -> None:
                hasher.update(chunk)
                hashed.append(len(chunk))
                entry[head:] = bytes([STRANGER]) * (len(entry) - head)

        real(target, source, Spy())

    monkeypatch.setattr(codec_verify, "_copy_hashing", copy_hashing)
    try:
        got = decode_entry(KEY, entry)
    except CorruptEntry:
        pass
    else:
        assert torch.equal(got, want)
    assert hashed
