"""Authenticated entries: the MAC, rotation, mixed fleets, and the secret kept out of sight."""

from __future__ import annotations

import copy
import hmac
import logging
import pickle
import struct
from pathlib import Path

import attrs
import blake3
import pytest
import torch
import xxhash
from hypothesis import example, given
from hypothesis import strategies as st

import mmkey.cache.codec as codec
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
from mmkey.cache.auth import (
    ENV_ACCEPT_UNAUTHENTICATED,
    ENV_PREVIOUS_FILES,
    ENV_SECRET,
    ENV_SECRET_FILE,
)
from mmkey.cache.codec import (
    FLAG_AUTHENTICATED,
    decode_entry,
    encode_entry,
    encode_entry_into,
    entry_size,
    peek_header,
)

SECRET = b"fleet secret number one, 32 byte+"
OLD_SECRET = b"the previous fleet secret (rotated out)"
OTHER_SECRET = b"a secret of some other fleet, not ours"
RING = EntryKeyring.from_secrets(SECRET)
KEY = EmbeddingKey("qwen2-vl-7b", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(7))
OTHER = EmbeddingKey("qwen2-vl-7b", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(8))
TEXT, OTHER_TEXT = KEY.to_key(), OTHER.to_key()
ENV_NAMES = (ENV_SECRET, ENV_SECRET_FILE, ENV_PREVIOUS_FILES, ENV_ACCEPT_UNAUTHENTICATED)


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def sample(
    shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
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
    covered_from = 72 if entry[7] == FLAG_AUTHENTICATED else 40  # all but the MAC
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
        b"MMKE", 1, 2, FLAG_AUTHENTICATED, len(TEXT), 0, 24,
    )
    assert head == (80 + 16 + len(TEXT) + 63) // 64 * 64 == len(data) - 24
    assert data[72:80] == key_id(SECRET) == RING.current.key_id
    assert struct.unpack_from("<2Q", data, 80) == (2, 3)
    assert data[96 : 96 + len(TEXT)] == TEXT.encode()
    payload_hash = blake3.blake3(data[head:]).digest()
    mac = blake3.blake3(data[:40] + data[72:head] + payload_hash, key=mac_key(SECRET))
    assert data[40:72] == mac.digest()
    assert data[24:40] == xxhash.xxh3_128(data[:24] + data[72:]).digest()
    assert peek_header(data).key_id == RING.current.key_id
    assert peek_header(encode_entry(TEXT, t)).key_id is None
    assert len(data) == entry_size(TEXT, t, keyring=RING) == entry_size(TEXT, t) + 64


def test_golden_authenticated_entry_never_changes() -> None:
    key = "mmk1@m@image@xxh3@" + "0" * 31 + "1"
    ring = EntryKeyring.from_secrets(b"\x01" * 32)
    data = encode_entry(key, torch.tensor([1, -2], dtype=torch.int16), keyring=ring)
    assert data.hex() == (
        "4d4d4b45" "01" "04" "01" "01" "3200" "c000" "00000000" "0400000000000000"
        "69596b7ed071a41125afd3f9ff153604"  # XXH3-128 of [0, 24) and [72, end)
        "429c8a0bf3ccacf671733e001c50f29f" "424f9cf4eec73c1cbabfa9c7d5b205aa"  # the MAC
        "3cdb1f8fc842d9d3"  # the secret's id
        "0200000000000000"
        + key.encode().hex()
        + "00" * 54
        + "0100" "feff"
    )
    assert decode_entry(key, data, keyring=ring).tolist() == [1, -2]
    assert decode_entry(key, data).tolist() == [1, -2]


def test_unauthenticated_entries_are_unchanged_by_a_keyring_elsewhere() -> None:
    t = sample((4,))
    assert encode_entry(TEXT, t) == encode_entry(TEXT, t, keyring=None)
    assert struct.unpack_from("<B", encode_entry(TEXT, t), 7) == (0,)


@pytest.mark.parametrize("payload", [0, 4, codec._FUSED_MAX, codec._FUSED_MAX + 64, 1 << 21])
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
        st.sets(
            st.tuples(st.integers(0, len(entry) - 1), st.integers(0, 7)), min_size=1, max_size=8
        )
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
@example(ENTRIES[0], 7, 1, True)  # flags 1 -> 0: a downgrade to an unauthenticated entry
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


def test_a_flip_without_a_fitting_checksum_counts_as_corruption_not_forgery() -> None:
    broken = bytearray(ENTRIES[0])
    broken[-1] ^= 4
    with pytest.raises(CorruptEntry, match="checksum") as info:
        decode_entry(TEXT, broken, keyring=RING)
    assert not isinstance(info.value, ForgedEntry)
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_entry(TEXT, broken)  # a reader without the secret still has the checksum


def test_a_writer_without_the_secret_is_refused() -> None:
    """Anyone can write a well-formed, checksummed entry under a valid key; it is not served."""
    t = sample((4, 8), 9)
    plain = encode_entry(TEXT, t)
    with pytest.raises(ForgedEntry, match="carries no MAC"):
        decode_entry(TEXT, plain, keyring=RING)
    migrating = attrs.evolve(RING, accept_unauthenticated=True)
    assert same(decode_entry(TEXT, plain, keyring=migrating), t)
    # the window opens for entries without a MAC only, never for a failed MAC
    with pytest.raises(ForgedEntry):
        decode_entry(TEXT, encode_entry(TEXT, t, keyring=EntryKeyring.from_secrets(OTHER_SECRET)),
                     keyring=migrating)


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
    with pytest.raises(ForgedEntry, match="does not hold"):
        decode_entry(TEXT, entry, keyring=RING)
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
    during = EntryKeyring.from_secrets(SECRET, OLD_SECRET)
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
    ring = EntryKeyring.from_secrets(SECRET, OLD_SECRET, accept_unauthenticated=True)
    assert ring.current.key_id == key_id(SECRET)
    assert [s.key_id for s in ring.previous] == [key_id(OLD_SECRET)]
    assert ring.secret_for(key_id(OLD_SECRET)) == EntrySecret.from_secret(OLD_SECRET)
    assert ring.secret_for(b"\0" * 8) is None
    assert EntrySecret.from_secret(SECRET.decode()) == EntrySecret.from_secret(SECRET)
    with pytest.raises(ValueError, match="at least 32"):
        EntryKeyring.from_secrets(b"x" * 31)
    with pytest.raises(ValueError, match="once"):
        EntryKeyring.from_secrets(SECRET, SECRET)
    with pytest.raises(TypeError, match="bytes or str"):
        EntryKeyring.from_secrets(12345)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EntrySecret"):
        EntryKeyring(SECRET)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EntryKeyring"):
        MemoryCache(1024, keyring=SECRET)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EntryKeyring"):
        encode_entry(TEXT, torch.zeros(1), keyring=SECRET)  # type: ignore[arg-type]


def test_from_env_reads_a_file_or_text(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert EntryKeyring.from_env() is None
    key_file = tmp_path / "entry.key"
    key_file.write_bytes(SECRET)
    old_file = tmp_path / "old.key"
    old_file.write_bytes(OLD_SECRET)
    assert EntryKeyring.from_env({ENV_SECRET_FILE: str(key_file)}) == RING
    assert EntryKeyring.from_env({ENV_SECRET: SECRET.decode()}) == RING
    ring = EntryKeyring.from_env(
        {
            ENV_SECRET_FILE: str(key_file),
            ENV_PREVIOUS_FILES: str(old_file),
            ENV_ACCEPT_UNAUTHENTICATED: "1",
        }
    )
    assert ring == EntryKeyring.from_secrets(SECRET, OLD_SECRET, accept_unauthenticated=True)
    monkeypatch.setenv(ENV_SECRET_FILE, str(key_file))
    assert EntryKeyring.from_env() == RING
    assert MemoryCache(1024).keyring == RING  # every cache reads it when built
    assert MemoryCache(1024, keyring=None).keyring is None  # unless code says otherwise
    other = EntryKeyring.from_secrets(OTHER_SECRET)
    assert MemoryCache(1024, keyring=other).keyring is other


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({ENV_SECRET: "", ENV_SECRET_FILE: "x"}, "not both"),
        ({ENV_SECRET: ""}, "0 bytes"),
        ({ENV_SECRET: "short secret"}, "at least 32"),
        ({ENV_SECRET_FILE: "/nonexistent/entry.key"}, "cannot read"),
        ({ENV_PREVIOUS_FILES: "/x"}, "need a current secret"),
        ({ENV_ACCEPT_UNAUTHENTICATED: "1"}, "need a current secret"),
        ({ENV_SECRET: SECRET.decode(), ENV_ACCEPT_UNAUTHENTICATED: "yes"}, "0 or 1"),
        ({ENV_SECRET: SECRET.decode(), ENV_PREVIOUS_FILES: "/nonexistent/old.key"}, "cannot read"),
    ],
)
def test_from_env_refuses_unusable_settings(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EntryKeyring.from_env(env)


def test_a_short_secret_file_is_refused_by_a_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    short = tmp_path / "short.key"
    short.write_bytes(b"k" * 31)
    monkeypatch.setenv(ENV_SECRET_FILE, str(short))
    with pytest.raises(ValueError, match=r"MMKEY_ENTRY_KEY_FILE.*at least 32|at least 32"):
        MemoryCache(1024)


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
    secret_text = "hunter2-" * 5
    secret = secret_text.encode()
    derived = mac_key(secret)
    needles = [secret_text, secret_text[:16], secret.hex(), derived.hex(), repr(derived)[2:-1][:24]]
    seen: list[str] = []
    caplog.set_level(logging.DEBUG)
    ring = EntryKeyring.from_secrets(secret, OLD_SECRET)
    cache = MemoryCache(1 << 20, keyring=ring)
    tiered = TieredCache(cache, MemoryCache(1 << 20, keyring=ring))
    seen += [repr(ring), str(ring), repr(ring.current), repr(cache), repr(tiered),
             repr(attrs.asdict(ring)), repr(cache.stats()), repr(tiered.stats())]
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
        lambda: EntryKeyring.from_secrets(secret, secret),
        lambda: EntryKeyring.from_secrets(secret[:31]),
        lambda: pickle.dumps(ring),
        lambda: EntryKeyring.from_env({ENV_SECRET: secret_text[:20]}),
    ):
        with pytest.raises(Exception) as info:
            attempt()
        failures.append(info.value)
    short = tmp_path / "short.key"
    short.write_bytes(secret[:31])
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
