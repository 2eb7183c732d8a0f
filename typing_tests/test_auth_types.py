"""Entry authentication: a keyring is the only thing a cache or the codec takes as one."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Literal

import torch
from typing_extensions import assert_type

from mmkey import EntryKeyring, EntrySecret, MemoryCache, MooncakeCache, MooncakeConfig
from mmkey.entry.auth import FROM_ENV
from mmkey.entry.codec import decode_entry, encode_entry, entry_size, verify, verify_entry, verify_entry_into
from mmkey.errors import ForgedEntry


def keyrings_are_accepted(config: MooncakeConfig, t: torch.Tensor) -> None:
    ring = EntryKeyring.from_secrets(b"x" * 32, ("ab" * 32, datetime(2999, 1, 1, tzinfo=timezone.utc)))
    MemoryCache(1 << 20, keyring=ring)
    MemoryCache(1 << 20, keyring=None)
    MemoryCache(1 << 20, keyring=FROM_ENV)
    MooncakeCache(config, keyring=ring)
    data = encode_entry("k", t, keyring=ring)
    assert_type(decode_entry("k", data, keyring=ring), torch.Tensor)
    assert_type(entry_size("k", t, keyring=ring), int)
    assert_type(EntryKeyring.from_env(), EntryKeyring | None)
    assert_type(ring.current, EntrySecret)
    assert_type(ring.current.key_id, bytes)
    assert_type(ring.secret_for(ring.current.key_id), EntrySecret | None)
    assert_type(ring.migrate_until, datetime | None)
    assert_type(ring.current.not_after, datetime | None)
    assert_type(verify_entry("k", data, keyring=ring), tuple[torch.Tensor, bool])
    assert_type(verify_entry_into("k", data, t, keyring=ring), bool)
    assert_type(verify("k", data, keyring=ring), tuple[torch.Tensor, bool])
    assert_type(verify("k", bytearray(data), copy=False), tuple[torch.Tensor, bool])
    assert_type(verify("k", data, t, keyring=ring), tuple[None, bool])
    assert_type(verify("k", data, [t, t]), tuple[None, bool])
    try:
        decode_entry("k", data, keyring=ring)
    except ForgedEntry as exc:
        assert_type(exc.reason, Literal["unsigned", "unknown_key", "expired", "bad_mac"])


def a_secret_is_not_a_keyring(t: torch.Tensor, secret: EntrySecret) -> None:
    MemoryCache(1 << 20, keyring=b"x" * 32)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    MemoryCache(1 << 20, keyring=secret)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    encode_entry("k", t, keyring="a secret")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    MemoryCache(1 << 20, EntryKeyring.from_secrets(b"x" * 32))  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    EntryKeyring.from_secrets(12345)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    EntryKeyring.from_secrets(b"x" * 32, b"y" * 32)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    EntryKeyring.from_secrets(b"x" * 32, migrate_until="2026-12-31")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
