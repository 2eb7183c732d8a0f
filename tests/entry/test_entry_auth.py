"""Authenticated entries: the MAC, rotation, mixed fleets, and the secret kept out of sight."""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import hmac
import logging
import os
import pickle
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import attrs
import blake3
import pytest
import torch
import xxhash
from hypothesis import example, given
from hypothesis import strategies as st

import mmkey.entry._encode as codec_encode
import mmkey.entry._format as codec_format
import mmkey.entry.codec as codec
from mmkey import (
    CorruptEntry,
    EmbeddingKey,
    EntryKeyring,
    EntrySecret,
    ForgedEntry,
    HashScheme,
    MemoryCache,
    Modality,
    TieredCache,
    mm_hash,
)
from mmkey.entry.auth import (
    ENV_AUTH,
    ENV_MIGRATE_UNTIL,
    ENV_PREVIOUS,
    ENV_SECRET,
    ENV_SECRET_FILE,
)
from mmkey.entry.codec import (
    FLAG_AUTHENTICATED,
    FLAG_ISSUED_AT,
    decode_entry,
    encode_entry,
    encode_entry_into,
    entry_size,
    peek_header,
)

SECRET = hashlib.sha256(b"fleet secret number one").digest()
OLD_SECRET = hashlib.sha256(b"the previous fleet secret (rotated out)").digest()
OTHER_SECRET = hashlib.sha256(b"a secret of some other fleet, not ours").digest()
RING = EntryKeyring.from_secrets(SECRET)
UTC = dt.timezone.utc
LATER = dt.datetime(2999, 1, 1, tzinfo=UTC)
"""A not-after time that never comes in these tests."""
KEY = EmbeddingKey("qwen2-vl-7b", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(7))
OTHER = EmbeddingKey("qwen2-vl-7b", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(8))
TEXT, OTHER_TEXT = KEY.to_key(), OTHER.to_key()
ENV_NAMES = (ENV_SECRET, ENV_SECRET_FILE, ENV_PREVIOUS, ENV_AUTH, ENV_MIGRATE_UNTIL)


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def sample(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for dim in shape:
        numel *= dim
    data = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return data.view(dtype).reshape(shape)


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


def mac_key(secret: bytes) -> bytes:
    """The MAC key as the format defines it, computed here from the spec."""
    return blake3.blake3(secret, derive_key_context="mmkey 2026-11-30 entry MAC key v1").digest()


def key_id(secret: bytes) -> bytes:
    return blake3.blake3(secret, derive_key_context="mmkey 2026-11-30 entry secret id v1").digest(8)


def refresh_checksum(entry: bytearray) -> bytearray:
    """What any writer can do: make the public XXH3 checksum fit the bytes again."""
    covered_from = 72 if entry[7] & FLAG_AUTHENTICATED else 40  # all but the MAC
    entry[24:40] = xxhash.xxh3_128(bytes(entry[:24]) + bytes(entry[covered_from:])).digest()
    return entry


# -- the format --------------------------------------------------------------------------


def test_authenticated_layout_is_the_documented_one() -> None:
    t = sample((2, 3))
    data = encode_entry(TEXT, t, keyring=RING)
    magic, version, code, ndim, flags, key_len, head, reserved, payload = struct.unpack_from(
        "<4sBBBBHHIQ", data
    )
    assert (magic, version, ndim, flags, key_len, reserved, payload) == (
        b"MMKE",
        1,
        2,
        FLAG_AUTHENTICATED | FLAG_ISSUED_AT,
        len(TEXT),
        0,
        24,
    )
    assert head == (88 + 16 + len(TEXT) + 63) // 64 * 64 == len(data) - 24
    assert data[72:80] == key_id(SECRET) == RING.current.key_id
    (issued,) = struct.unpack_from("<Q", data, 80)
    assert abs(issued - time.time()) < 60
    assert struct.unpack_from("<2Q", data, 88) == (2, 3)
    assert data[104 : 104 + len(TEXT)] == TEXT.encode()
    payload_hash = blake3.blake3(data[head:]).digest()
    mac = blake3.blake3(data[:40] + data[72:head] + payload_hash, key=mac_key(SECRET))
    assert data[40:72] == mac.digest()
    assert data[24:40] == xxhash.xxh3_128(data[:24] + data[72:]).digest()
    assert peek_header(data).key_id == RING.current.key_id
    assert peek_header(data).issued_at == issued
    assert peek_header(encode_entry(TEXT, t)).key_id is None
    assert len(data) == entry_size(TEXT, t, keyring=RING) == entry_size(TEXT, t) + 64


GOLDEN_KEY = "mmk1@m@image@xxh3@" + "0" * 31 + "1"
GOLDEN_RING = EntryKeyring(EntrySecret._derive(b"\x01" * 32))
"""The vectors' secret predates the rule that secrets are random bytes: made without it."""


def test_golden_authenticated_entry_still_verifies() -> None:
    """Entries signed before issue times (flag 1 alone) are read as they always were."""
    key, ring = GOLDEN_KEY, GOLDEN_RING
    data = bytes.fromhex(
        "4d4d4b45"
        "01"
        "04"
        "01"
        "01"
        "3200"
        "c000"
        "00000000"
        "0400000000000000"
        "69596b7ed071a41125afd3f9ff153604"  # XXH3-128 of [0, 24) and [72, end)
        "429c8a0bf3ccacf671733e001c50f29f"
        "424f9cf4eec73c1cbabfa9c7d5b205aa"  # the MAC
        "3cdb1f8fc842d9d3"  # the secret's id
        "0200000000000000" + key.encode().hex() + "00" * 54 + "0100"
        "feff"
    )
    assert decode_entry(key, data, keyring=ring).tolist() == [1, -2]
    assert decode_entry(key, data).tolist() == [1, -2]
    assert peek_header(data).issued_at is None


def test_golden_entry_with_an_issue_time_never_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_encode, "_clock", lambda: 1_796_000_000.5)
    key, ring = GOLDEN_KEY, GOLDEN_RING
    data = encode_entry(key, torch.tensor([1, -2], dtype=torch.int16), keyring=ring)
    assert (
        data.hex()
        == (
            "4d4d4b45"
            "01"
            "04"
            "01"
            "03"
            "3200"
            "c000"
            "00000000"
            "0400000000000000"
            "576e0f19e8a26014bd4ce9bb325a57c3"  # XXH3-128 of [0, 24) and [72, end)
            "858127c284f240d8a6c61d9a5ebe813c"
            "caf2d98182f58303d8aee7ca39281d96"  # the MAC
            "3cdb1f8fc842d9d3"  # the secret's id
            "00c90c6b00000000"  # issued at 1796000000 s (2026-11-30T00:53:20Z), u64
            "0200000000000000" + key.encode().hex() + "00" * 46 + "0100"
            "feff"
        )
    )
    assert data[24:40] == xxhash.xxh3_128(data[:24] + data[72:]).digest()
    assert decode_entry(key, data, keyring=ring).tolist() == [1, -2]
    assert peek_header(data).issued_at == 1_796_000_000


def test_unauthenticated_entries_are_unchanged_by_a_keyring_elsewhere() -> None:
    t = sample((4,))
    assert encode_entry(TEXT, t) == encode_entry(TEXT, t, keyring=None)
    assert struct.unpack_from("<B", encode_entry(TEXT, t), 7) == (0,)


@pytest.mark.parametrize("payload", [0, 4, codec_format._CHUNK, codec_format._CHUNK + 64, 1 << 21])
def test_round_trips_on_every_copy_path(payload: int) -> None:
    t = sample((payload,), dtype=torch.uint8)
    data = encode_entry(TEXT, t, keyring=RING)
    into = bytearray(len(data) + 7)
    assert encode_entry_into(into, TEXT, t, keyring=RING) == len(data)
    assert bytes(into[: len(data)]) == data
    assert same(decode_entry(TEXT, data, keyring=RING), t)
    assert same(decode_entry(TEXT, bytearray(data), keyring=RING, copy=False), t)
    forged = refresh_checksum(bytearray(encode_entry(TEXT, t, keyring=RING)))
    if payload:
        forged[-1] ^= 1
        refresh_checksum(forged)
        with pytest.raises(ForgedEntry, match="fails its MAC"):
            decode_entry(TEXT, forged, keyring=RING)
        with pytest.raises(ForgedEntry):
            decode_entry(TEXT, forged, keyring=RING, copy=False)


def test_macs_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: memoryview) -> bool:
        calls.append(len(b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    decode_entry(TEXT, encode_entry(TEXT, sample((3,)), keyring=RING), keyring=RING)
    assert calls == [32]


# -- forgeries and accidents -------------------------------------------------------------

ENTRIES = [
    encode_entry(TEXT, sample((4, 8), 1), keyring=RING),
    encode_entry(TEXT, sample((3,), 2, torch.bfloat16), keyring=RING),
    encode_entry(TEXT, torch.tensor(True), keyring=RING),
    encode_entry(TEXT, torch.empty(0, 5, dtype=torch.int64), keyring=RING),
    encode_entry(TEXT, sample((300, 256), 3, torch.int32), keyring=RING),  # the large path
]


@given(st.sampled_from(ENTRIES), st.data(), st.booleans())
def test_any_bit_flip_is_never_served(entry: bytes, data: st.DataObject, fix: bool) -> None:
    """Flips anywhere, with or without the public checksum made to fit again."""
    spots = data.draw(
        st.sets(st.tuples(st.integers(0, len(entry) - 1), st.integers(0, 7)), min_size=1, max_size=8)
    )
    broken = bytearray(entry)
    for at, bit in spots:
        broken[at] ^= 1 << bit
    if fix:
        refresh_checksum(broken)
    if broken == entry:
        return  # the flips touched only the checksum field and were undone
    with pytest.raises(CorruptEntry):
        decode_entry(TEXT, broken, keyring=RING)
    payload_only = all(at >= peek_header(entry).header_size for at, _ in spots)
    if fix and payload_only:
        with pytest.raises(ForgedEntry, match="fails its MAC"):
            decode_entry(TEXT, broken, keyring=RING)


@given(st.sampled_from(ENTRIES), st.integers(0, 10**6), st.integers(1, 255), st.booleans())
@example(ENTRIES[0], 7, 2, True)  # flags 3 -> 1: the issue time dropped
@example(ENTRIES[0], 7, 255, True)  # flags 3 -> 2: a flag set no writer makes
@example(ENTRIES[0], 72, 1, True)  # the secret id
@example(ENTRIES[0], 40, 0x80, True)  # the MAC's first byte
@example(ENTRIES[0], 24, 1, False)  # the checksum, which the MAC covers
@example(ENTRIES[4], 10**6 - 1, 1, True)  # the large (hash, then clone) path
def test_any_byte_change_is_never_served(entry: bytes, at: int, delta: int, fix: bool) -> None:
    broken = bytearray(entry)
    at %= len(entry)
    broken[at] = (broken[at] + delta) % 256
    if fix:
        refresh_checksum(broken)
    if broken == entry:
        return
    with pytest.raises(CorruptEntry):
        decode_entry(TEXT, broken, keyring=RING)


def test_under_a_keyring_every_failure_is_forged_even_a_bad_checksum() -> None:
    """A forger can break the public checksum on purpose: under a keyring that is an attack
    like any other, never an accident counted as `corrupt`."""
    broken = bytearray(ENTRIES[0])
    broken[-1] ^= 4
    with pytest.raises(ForgedEntry, match="fails its MAC") as info:
        decode_entry(TEXT, broken, keyring=RING)
    assert info.value.reason == "bad_mac"
    for cut in (ENTRIES[0][:30], ENTRIES[0][:-1], b"junk" * 40):  # malformed, truncated
        with pytest.raises(ForgedEntry) as info:
            decode_entry(TEXT, cut, keyring=RING)
        assert info.value.reason == "bad_mac"
    with pytest.raises(ForgedEntry, match="written under key"):
        decode_entry(OTHER_TEXT, ENTRIES[0], keyring=RING)
    with pytest.raises(CorruptEntry, match="checksum") as plain:
        decode_entry(TEXT, broken)  # a reader without the secret still has the checksum
    assert not isinstance(plain.value, ForgedEntry)


def test_a_writer_without_the_secret_is_refused() -> None:
    """Anyone can write a well-formed, checksummed entry under a valid key; it is not served."""
    t = sample((4, 8), 9)
    plain = encode_entry(TEXT, t)
    with pytest.raises(ForgedEntry, match="carries no MAC") as info:
        decode_entry(TEXT, plain, keyring=RING)
    assert info.value.reason == "unsigned"
    migrating = attrs.evolve(RING, migrate_until=LATER)
    assert same(decode_entry(TEXT, plain, keyring=migrating), t)
    ended = attrs.evolve(RING, migrate_until=dt.datetime(2020, 1, 1, tzinfo=UTC))
    with pytest.raises(ForgedEntry, match="carries no MAC"):
        decode_entry(TEXT, plain, keyring=ended)  # the window closed
    # the window opens for entries without a MAC only, never for a failed MAC
    with pytest.raises(ForgedEntry):
        decode_entry(
            TEXT, encode_entry(TEXT, t, keyring=EntryKeyring.from_secrets(OTHER_SECRET)), keyring=migrating
        )


def test_a_downgraded_entry_is_an_unauthenticated_one() -> None:
    """Strip the MAC and rebuild a valid unauthenticated entry around the same payload."""
    t = sample((4, 8), 1)
    stripped = encode_entry(TEXT, t)
    assert stripped[-128:] == ENTRIES[0][-128:]
    with pytest.raises(ForgedEntry, match="carries no MAC"):
        decode_entry(TEXT, stripped, keyring=RING)


def test_wrong_secret_and_a_claimed_secret_id() -> None:
    t = sample((5,))
    theirs = EntryKeyring.from_secrets(OTHER_SECRET)
    entry = encode_entry(TEXT, t, keyring=theirs)
    with pytest.raises(ForgedEntry, match="does not hold") as info:
        decode_entry(TEXT, entry, keyring=RING)
    assert info.value.reason == "unknown_key"
    assert pickle.loads(pickle.dumps(info.value)).reason == "unknown_key"
    claimed = bytearray(entry)
    claimed[72:80] = RING.current.key_id  # the id is public: a forger can name our secret
    with pytest.raises(ForgedEntry, match="fails its MAC"):
        decode_entry(TEXT, refresh_checksum(claimed), keyring=RING)


def test_truncated_macs_are_refused() -> None:
    entry = ENTRIES[0]
    head = peek_header(entry).header_size
    for keep in (0, 1, 16, 31):
        short = bytearray(entry)
        short[40 + keep : 72] = bytes(32 - keep)  # only a prefix of the MAC is right
        with pytest.raises(ForgedEntry, match="fails its MAC"):
            decode_entry(TEXT, refresh_checksum(short), keyring=RING)
        cut = bytearray(entry[: 40 + keep] + entry[72:])  # MAC bytes removed outright
        with pytest.raises(CorruptEntry):
            decode_entry(TEXT, refresh_checksum(cut), keyring=RING)
    for size in (40, 72, 79, head - 1, len(entry) - 1):
        with pytest.raises(CorruptEntry):
            decode_entry(TEXT, entry[:size], keyring=RING)


def test_an_entry_moved_to_another_key_is_refused() -> None:
    entry = ENTRIES[0]
    with pytest.raises(CorruptEntry, match="written under key"):
        decode_entry(OTHER_TEXT, entry, keyring=RING)
    moved = bytearray(entry)
    at = moved.index(TEXT.encode())
    moved[at : at + len(OTHER_TEXT)] = OTHER_TEXT.encode()  # same length, echo rewritten
    with pytest.raises(ForgedEntry, match="fails its MAC"):
        decode_entry(OTHER_TEXT, refresh_checksum(moved), keyring=RING)


def test_rotation_accepts_previous_secrets_and_writes_with_the_current_one() -> None:
    t_old, t_new = sample((6,), 1), sample((6,), 2)
    before = EntryKeyring.from_secrets(OLD_SECRET)
    during = EntryKeyring.from_secrets(SECRET, (OLD_SECRET, LATER))
    after = EntryKeyring.from_secrets(SECRET)
    old_entry = encode_entry(TEXT, t_old, keyring=before)
    new_entry = encode_entry(TEXT, t_new, keyring=during)
    assert peek_header(new_entry).key_id == key_id(SECRET)
    assert same(decode_entry(TEXT, old_entry, keyring=during), t_old)
    assert same(decode_entry(TEXT, new_entry, keyring=during), t_new)
    assert same(decode_entry(TEXT, new_entry, keyring=after), t_new)
    with pytest.raises(ForgedEntry, match="does not hold"):
        decode_entry(TEXT, old_entry, keyring=after)  # rotated out for good
    with pytest.raises(ForgedEntry, match="does not hold"):
        decode_entry(TEXT, new_entry, keyring=before)  # a reader not yet given the new secret


def test_a_reader_without_a_secret_serves_authenticated_entries_after_their_checksum() -> None:
    """The migration path: such a reader has no MAC to check, and refusing would gain nothing."""
    t = sample((4, 8), 1)
    assert same(decode_entry(TEXT, ENTRIES[0]), t)
    cache = MemoryCache(1 << 20)
    assert cache.keyring is None
    cache._entries[TEXT] = ENTRIES[0]  # as if a signing writer put it there
    cache._held += len(ENTRIES[0])
    [got] = cache.get_embeddings([KEY])
    assert got is not None and same(got, t)


# -- keyrings ------------------------------------------------------------------------------


def test_keyring_construction_and_refusals() -> None:
    ring = EntryKeyring.from_secrets(SECRET, (OLD_SECRET, LATER), migrate_until=LATER)
    assert ring.current.key_id == key_id(SECRET)
    assert [s.key_id for s in ring.previous] == [key_id(OLD_SECRET)]
    assert ring.secret_for(key_id(OLD_SECRET)) == EntrySecret.from_secret(OLD_SECRET, not_after=LATER)
    assert ring.secret_for(b"\0" * 8) is None
    assert EntrySecret.from_secret(SECRET.hex()) == EntrySecret.from_secret(SECRET)
    assert EntrySecret.from_secret(SECRET.hex().upper()) == EntrySecret.from_secret(SECRET)
    with pytest.raises(ValueError, match="once"):
        EntryKeyring.from_secrets(SECRET, (SECRET, LATER))
    with pytest.raises(ValueError, match="not_after"):
        EntryKeyring(EntrySecret.from_secret(SECRET), (EntrySecret.from_secret(OLD_SECRET),))
    with pytest.raises(TypeError, match="pairs"):
        EntryKeyring.from_secrets(SECRET, OLD_SECRET)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timezone"):
        EntryKeyring.from_secrets(SECRET, (OLD_SECRET, dt.datetime(2999, 1, 1)))
    with pytest.raises(TypeError, match="bytes or str"):
        EntryKeyring.from_secrets(12345)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EntrySecret"):
        EntryKeyring(SECRET)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EntryKeyring"):
        MemoryCache(1024, keyring=SECRET)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EntryKeyring"):
        encode_entry(TEXT, torch.zeros(1), keyring=SECRET)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("secret", "message"),
    [
        (b"password" * 4, "not a password"),  # 32 bytes, but text
        (b"a" * 32, "not a password"),
        ("a" * 32, "64 hex digits"),
        ("password" * 4, "64 hex digits"),
        (b"\0" * 32, "not a password"),  # repeats itself
        ("00" * 32, "not a password"),
        (SECRET[:31], "exactly 32"),
        (SECRET + b"\0", "exactly 32"),
        (SECRET.hex() + "\n", "trailing newline"),
        (" " + SECRET.hex(), "white space"),
        (SECRET.hex()[:63], "64 hex digits"),
        (SECRET.hex() + "0", "64 hex digits"),
    ],
)
def test_secrets_are_32_random_bytes_and_nothing_else(secret: bytes | str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        EntrySecret.from_secret(secret)
    assert "secrets.token_hex(32)" in str(info.value) or "printf" in str(info.value)


def test_from_env_reads_a_file_or_text(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert EntryKeyring.from_env() is None
    key_file = write_secret(tmp_path / "entry.key", SECRET.hex())
    old_file = write_secret(tmp_path / "old.key", OLD_SECRET.hex())
    assert EntryKeyring.from_env({ENV_SECRET_FILE: str(key_file)}) == RING
    assert EntryKeyring.from_env({ENV_SECRET: SECRET.hex()}) == RING
    ring = EntryKeyring.from_env(
        {
            ENV_SECRET_FILE: str(key_file),
            ENV_PREVIOUS: f"{old_file}@2999-01-01T00:00:00Z",
            ENV_AUTH: "migrate",
            ENV_MIGRATE_UNTIL: "2999-01-01T00:00:00+00:00",
        }
    )
    assert ring == EntryKeyring.from_secrets(SECRET, (OLD_SECRET, LATER), migrate_until=LATER)
    monkeypatch.setenv(ENV_SECRET_FILE, str(key_file))
    assert EntryKeyring.from_env() == RING
    assert MemoryCache(1024).keyring == RING  # every cache reads it when built
    assert MemoryCache(1024, keyring=None).keyring is None  # unless code says otherwise
    other = EntryKeyring.from_secrets(OTHER_SECRET)
    assert MemoryCache(1024, keyring=other).keyring is other


def write_secret(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({ENV_SECRET: "", ENV_SECRET_FILE: "x"}, "not both"),
        ({ENV_SECRET: ""}, "64 hex digits"),
        ({ENV_SECRET: "short secret"}, "64 hex digits"),
        ({ENV_SECRET: SECRET.hex() + "\n"}, "trailing newline"),
        ({ENV_SECRET_FILE: "/nonexistent/entry.key"}, "cannot read"),
        ({ENV_PREVIOUS: "/x@2999-01-01T00:00:00Z"}, "need a current secret"),
        (
            {ENV_SECRET: SECRET.hex(), ENV_PREVIOUS: "/nonexistent/old.key@2999-01-01T00:00:00Z"},
            "cannot read",
        ),
        ({ENV_SECRET: SECRET.hex(), ENV_PREVIOUS: "/x"}, "path>@<ISO-8601"),
        ({ENV_SECRET: SECRET.hex(), ENV_PREVIOUS: "/x@tomorrow"}, "ISO-8601 UTC"),
        ({ENV_SECRET: SECRET.hex(), ENV_PREVIOUS: "/x@2999-01-01T00:00:00+02:00"}, "ISO-8601 UTC"),
        ({ENV_SECRET: SECRET.hex(), ENV_PREVIOUS: "/x@2999-01-01T00:00:00"}, "ISO-8601 UTC"),
        ({ENV_AUTH: "yes"}, "required, migrate or off"),
        ({ENV_AUTH: "migrate", ENV_SECRET: SECRET.hex()}, "go together"),
        ({ENV_MIGRATE_UNTIL: "2999-01-01T00:00:00Z", ENV_SECRET: SECRET.hex()}, "go together"),
        ({ENV_AUTH: "migrate", ENV_MIGRATE_UNTIL: "2999-01-01T00:00:00Z"}, "need a current"),
        ({ENV_AUTH: "off", ENV_SECRET: SECRET.hex()}, "off with an entry secret"),
        ({"MMKEY_ENTRY_ACCEPT_UNAUTHENTICATED": "1"}, "MMKEY_ENTRY_MIGRATE_UNTIL"),
        ({"MMKEY_ENTRY_KEY_PREVIOUS_FILES": "/x"}, "MMKEY_ENTRY_KEY_PREVIOUS="),
    ],
)
def test_from_env_refuses_unusable_settings(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EntryKeyring.from_env(env)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o666, 0o660])
def test_a_secret_file_others_can_read_is_refused_naming_the_fix(tmp_path: Path, mode: int) -> None:
    key_file = write_secret(tmp_path / "entry.key", SECRET.hex(), mode)
    with pytest.raises(ValueError, match=f"chmod 600 {key_file}"):
        EntryKeyring.from_env({ENV_SECRET_FILE: str(key_file)})
    key_file.chmod(0o400)
    assert EntryKeyring.from_env({ENV_SECRET_FILE: str(key_file)}) == RING


def test_a_secret_file_with_a_trailing_newline_is_refused_naming_the_fix(tmp_path: Path) -> None:
    key_file = write_secret(tmp_path / "entry.key", SECRET.hex() + "\n")
    with pytest.raises(ValueError, match="trailing newline") as info:
        EntryKeyring.from_env({ENV_SECRET_FILE: str(key_file)})
    assert "printf %s" in str(info.value)


def test_the_documented_command_makes_a_secret_file_that_loads(tmp_path: Path) -> None:
    guide = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    [command] = [line.strip() for line in guide.splitlines() if "token_hex(32)" in line]
    subprocess.run(["sh", "-c", command], cwd=tmp_path, check=True)
    key_file = tmp_path / "entry.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    ring = EntryKeyring.from_env({ENV_SECRET_FILE: str(key_file)})
    assert ring is not None and len(key_file.read_bytes()) == 64


def test_the_secret_variable_leaves_the_environment_once_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_SECRET, SECRET.hex())
    assert MemoryCache(1024).keyring == RING
    assert ENV_SECRET not in os.environ  # child processes do not inherit it
    child = subprocess.run(
        [sys.executable, "-c", f"import os; print(os.environ.get({ENV_SECRET!r}))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip() == "None"
    assert MemoryCache(1024).keyring == RING  # later caches of this process still have it
    mapping = {ENV_SECRET: OTHER_SECRET.hex()}
    assert EntryKeyring.from_env(mapping) == EntryKeyring.from_secrets(OTHER_SECRET)
    assert mapping == {}  # any mapping given is treated the same


def test_auth_modes_for_a_shared_store(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`keyring_for_cache` as a cache over a shared store calls it."""
    from mmkey.entry.auth import FROM_ENV, keyring_for_cache

    caplog.set_level(logging.WARNING, "mmkey.cache.auth")
    assert keyring_for_cache(FROM_ENV, "Cache", shared=True) is None  # unset: today's default
    assert [r.getMessage() for r in caplog.records] == [
        "Cache has no entry secret: anyone who reaches the store can write entries it will "
        "serve; set MMKEY_ENTRY_KEY_FILE (or MMKEY_ENTRY_AUTH=off to say this is intended)"
    ]
    caplog.clear()
    assert keyring_for_cache(None, "Cache", shared=True) is None  # said on purpose: no warning
    assert keyring_for_cache(FROM_ENV, "Cache") is None  # not shared: no warning
    monkeypatch.setenv(ENV_AUTH, "off")
    assert keyring_for_cache(FROM_ENV, "Cache", shared=True) is None
    assert caplog.records == []
    for mode in ("required", "migrate"):
        monkeypatch.setenv(ENV_AUTH, mode)
        if mode == "migrate":
            monkeypatch.setenv(ENV_MIGRATE_UNTIL, "2999-01-01T00:00:00Z")
        with pytest.raises(ValueError, match=f"MMKEY_ENTRY_AUTH={mode}: Cache over a shared"):
            keyring_for_cache(None, "Cache", shared=True)
        monkeypatch.delenv(ENV_MIGRATE_UNTIL, raising=False)
    monkeypatch.setenv(ENV_AUTH, "required")
    with pytest.raises(ValueError, match="needs an entry secret"):
        keyring_for_cache(FROM_ENV, "Cache", shared=True)
    assert keyring_for_cache(RING, "Cache", shared=True) is RING
    monkeypatch.setenv(ENV_SECRET, SECRET.hex())
    assert keyring_for_cache(FROM_ENV, "Cache", shared=True) == RING
    assert MemoryCache(1024, keyring=None).keyring is None  # not a shared store


def test_migrate_serves_unsigned_entries_until_its_end_and_counts_them() -> None:
    t = sample((4,), 3)
    plain = encode_entry(TEXT, t)
    soon = dt.datetime.now(UTC) + dt.timedelta(seconds=2)
    ring = attrs.evolve(RING, migrate_until=soon)
    assert ring.serves_unsigned()
    assert codec.verify(TEXT, plain, keyring=ring)[1] is True  # served, said unsigned
    signed = encode_entry(TEXT, t, keyring=ring)
    assert codec.verify(TEXT, signed, keyring=ring)[1] is False
    assert not ring.serves_unsigned(soon.timestamp() + 0.001)
    past = attrs.evolve(RING, migrate_until=dt.datetime.now(UTC) - dt.timedelta(seconds=1))
    with pytest.raises(ForgedEntry) as info:
        decode_entry(TEXT, plain, keyring=past)
    assert info.value.reason == "unsigned"


def test_previous_secrets_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    """After its not-after time a previous secret's entries are refused, counted apart; an
    entry whose MAC-covered issue time is past it is refused even before."""
    now = time.time()
    not_after = dt.datetime.fromtimestamp(now + 3600, UTC)
    old_ring = EntryKeyring.from_secrets(OLD_SECRET)
    rotated = EntryKeyring.from_secrets(SECRET, (OLD_SECRET, not_after))
    t = sample((4,), 5)
    legit = encode_entry(TEXT, t, keyring=old_ring)
    assert same(decode_entry(TEXT, legit, keyring=rotated), t)
    monkeypatch.setattr(codec_encode, "_clock", lambda: now + 7200)  # a forger with the old secret
    late = encode_entry(TEXT, t, keyring=old_ring)
    with pytest.raises(ForgedEntry, match="expired") as info:
        decode_entry(TEXT, late, keyring=rotated)
    assert info.value.reason == "expired"
    monkeypatch.setattr(time, "time", lambda: now + 7200)  # the not-after time passed
    with pytest.raises(ForgedEntry, match="expired"):
        decode_entry(TEXT, legit, keyring=rotated)
    assert same(decode_entry(TEXT, encode_entry(TEXT, t, keyring=rotated), keyring=rotated), t)


# -- caches --------------------------------------------------------------------------------


def test_memory_cache_counts_forged_entries_apart_and_drops_them() -> None:
    cache = MemoryCache(1 << 20, keyring=RING)
    genuine = sample((4, 8), 1)
    assert cache.insert_batch([KEY, OTHER], [genuine, genuine]) == [True, True]
    assert peek_header(cache._entries[TEXT]).key_id == RING.current.key_id
    forged_entry = encode_entry(OTHER_TEXT, torch.zeros(4, 8))  # a writer without the secret
    cache._held += len(forged_entry) - len(cache._entries[OTHER_TEXT])
    cache._entries[OTHER_TEXT] = forged_entry
    held_before = cache.stats().bytes_held
    got = cache.get_embeddings([KEY, OTHER])
    assert got[0] is not None and same(got[0], genuine)
    assert got[1] is None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.forged, stats.corrupt) == (1, 1, 1, 0)
    assert (stats.unsigned, stats.unknown_key, stats.expired, stats.bad_mac) == (1, 0, 0, 0)
    assert cache.batch_is_exist([KEY, OTHER]) == [True, False]
    assert held_before is not None and stats.bytes_held is not None  # a MemoryCache knows
    assert held_before - stats.bytes_held == len(forged_entry)  # dropped


def test_a_forged_far_entry_never_reaches_or_displaces_the_near_tier() -> None:
    l1 = MemoryCache(1 << 20, keyring=RING)
    l2 = MemoryCache(1 << 20, keyring=RING)
    tiered = TieredCache(l1, l2)
    genuine = sample((4, 8), 1)
    assert tiered.insert_batch([KEY], [genuine]) == [True]
    for key in (KEY, OTHER):  # forged entries replace what the far tier holds
        text = key.to_key()
        entry = encode_entry(text, torch.full((4, 8), 666.0))
        l2._held += len(entry) - len(l2._entries.get(text, b""))
        l2._entries[text] = entry
    held_before = dict(l1._entries)
    [near, far] = tiered.get_embeddings([KEY, OTHER])
    assert near is not None and same(near, genuine)
    assert far is None
    assert tiered.prefetch([OTHER]) == 0
    assert l1._entries == held_before  # nothing promoted, nothing evicted or replaced
    assert tiered.stats().forged == 1 and l1.stats().forged == 0


# -- the secret stays out of sight ----------------------------------------------------------


def test_the_secret_never_shows(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = hashlib.sha256(b"hunter2").digest()
    secret_text = secret.hex()
    derived = mac_key(secret)
    needles = [secret_text, secret_text[:16], derived.hex(), repr(derived)[2:-1][:24]]
    seen: list[str] = []
    caplog.set_level(logging.DEBUG)
    ring = EntryKeyring.from_secrets(secret, (OLD_SECRET, LATER))
    cache = MemoryCache(1 << 20, keyring=ring)
    tiered = TieredCache(cache, MemoryCache(1 << 20, keyring=ring))
    seen += [
        repr(ring),
        str(ring),
        repr(ring.current),
        repr(cache),
        repr(tiered),
        repr(attrs.asdict(ring)),
        repr(cache.stats()),
        repr(tiered.stats()),
    ]
    tiered.insert_batch([KEY], [sample((3,))])
    entry = encode_entry(TEXT, sample((3,)), keyring=ring)
    broken = refresh_checksum(bytearray(entry))
    broken[-1] ^= 1
    refresh_checksum(broken)
    failures: list[BaseException] = []
    for attempt in (
        lambda: decode_entry(TEXT, broken, keyring=ring),
        lambda: decode_entry(TEXT, encode_entry(TEXT, sample((3,))), keyring=ring),
        lambda: decode_entry(TEXT, entry, keyring=EntryKeyring.from_secrets(OTHER_SECRET)),
        lambda: EntryKeyring.from_secrets(secret, (secret, LATER)),
        lambda: EntryKeyring.from_secrets(secret[:31]),
        lambda: pickle.dumps(ring),
        lambda: EntryKeyring.from_env({ENV_SECRET: secret_text[:20]}),
    ):
        with pytest.raises(Exception) as info:
            attempt()
        failures.append(info.value)
    short = tmp_path / "short.key"
    short.write_bytes(secret_text[:63].encode())
    short.chmod(0o600)
    monkeypatch.setenv(ENV_SECRET_FILE, str(short))
    with pytest.raises(ValueError) as info:
        MemoryCache(1024)
    failures.append(info.value)
    for exc in failures:
        seen += [str(exc), repr(exc), repr(exc.args)]
    seen += [record.getMessage() for record in caplog.records]
    assert copy.deepcopy(ring) == ring
    text = "\n".join(seen)
    for needle in needles:
        assert needle not in text
    assert ring.current.key_id.hex() in text  # the control: the id is what shows
