"""Against a real local master: what Mooncake's tenants isolate, and authenticated entries."""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import torch

from mmkey import (
    EmbeddingKey,
    EntryKeyring,
    HashScheme,
    MemoryCache,
    Modality,
    MooncakeCache,
    MooncakeConfig,
    TieredCache,
    mm_hash,
)
from mmkey.entry.auth import ENV_SECRET, FROM_ENV
from mmkey.entry.codec import encode_entry, entry_size
from mmkey.testing.mooncake_master import MasterProcess
from tests._support import local_config, raw_client

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

pytestmark = pytest.mark.mooncake

MiB = 1 << 20
RUN = uuid.uuid4().hex[:12]
"""Keys of this run differ from those of any other run on a shared master."""


@pytest.fixture
def tenant_stores(
    mooncake_master_session: MasterProcess,
) -> Iterator[tuple[MooncakeDistributedStore, MooncakeDistributedStore]]:
    """Two raw clients of one master: ``alpha`` holds a segment, ``beta`` is a pure client."""
    from mooncake.store import MooncakeDistributedStore

    stores = []
    try:
        for tenant, segment in (("alpha", 64 * MiB), ("beta", 0)):
            store = MooncakeDistributedStore()
            stores.append(store)
            rc = store.setup(
                "127.0.0.1",
                "P2PHANDSHAKE",
                segment,
                16 * MiB,
                "tcp",
                "",
                mooncake_master_session.address,
                tenant_id=tenant,
            )
            assert rc == 0
        yield stores[0], stores[1]
    finally:
        for store in stores:
            store.close()


def test_tenants_do_not_isolate_keys(
    tenant_stores: tuple[MooncakeDistributedStore, MooncakeDistributedStore],
) -> None:
    """Measured with the installed binding: another tenant reads, overwrites and removes a key."""
    alpha, beta = tenant_stores
    key = f"tenant-{uuid.uuid4().hex}"
    assert alpha.put(key, b"A" * 1000) == 0
    assert beta.is_exist(key) == 1
    assert beta.get(key) == b"A" * 1000
    assert beta.upsert(key, b"B" * 1000) == 0
    assert alpha.get(key) == b"B" * 1000
    assert beta.remove(key, True) == 0
    assert alpha.is_exist(key) == 0


# -- MooncakeCache with a fleet secret --------------------------------------------------------

SECRET = hashlib.sha256(b"fleet secret of the mooncake tests").digest()
RING = EntryKeyring.from_secrets(SECRET)
LATER = dt.datetime(2999, 1, 1, tzinfo=dt.timezone.utc)


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey(f"auth-{RUN}", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


def config(master: MasterProcess, **overrides: Any) -> MooncakeConfig:
    # generous timeouts: only a hang may fail these tests
    return local_config(master, **{"timeout": 5.0, "setup_timeout": 10.0, **overrides})


@pytest.fixture
def raw_store(mooncake_master_session: MasterProcess) -> Iterator[MooncakeDistributedStore]:
    """A raw binding client: a writer that knows the key format but not the secret."""
    with raw_client(config(mooncake_master_session, global_segment_size=0)) as store:
        yield store


@pytest.fixture
def signed(mooncake_master_session: MasterProcess) -> Iterator[MooncakeCache]:
    with MooncakeCache(config(mooncake_master_session), keyring=RING) as cache:
        yield cache


def forge(store: MooncakeDistributedStore, k: EmbeddingKey, tensor: torch.Tensor) -> None:
    """Store a well-formed, checksummed entry under a valid key, without the secret."""
    assert store.upsert(k.to_key(), encode_entry(k.to_key(), tensor)) == 0


def test_an_authenticated_reader_never_serves_entries_written_without_the_secret(
    mooncake_master_session: MasterProcess,
    signed: MooncakeCache,
    raw_store: MooncakeDistributedStore,
) -> None:
    genuine, evil = torch.randn(16, 64), torch.full((16, 64), 666.0)
    assert signed.insert_batch([key(1), key(2)], [genuine, genuine]) == [True, True]
    forge(raw_store, key(2), evil)  # replaces a genuine entry
    forge(raw_store, key(3), evil)  # a new key
    with MooncakeCache(config(mooncake_master_session, global_segment_size=0), keyring=None) as plain:
        assert plain.insert_batch([key(4)], [evil]) == [True]  # mmkey without the secret
        got = plain.get_embeddings([key(1)])[0]  # a reader without it serves signed entries
        assert got is not None and torch.equal(got, genuine)
    other = EntryKeyring.from_secrets(hashlib.sha256(b"some other fleet's secret").digest())
    with MooncakeCache(config(mooncake_master_session, global_segment_size=0), keyring=other) as them:
        assert them.insert_batch([key(5)], [evil]) == [True]  # a wrong secret
    moved = raw_store.get(key(1).to_key())
    assert raw_store.upsert(key(6).to_key(), moved) == 0  # a genuine entry under another key
    found = signed.get_embeddings([key(i) for i in range(1, 7)])
    assert found[0] is not None and torch.equal(found[0], genuine)
    assert found[1:] == [None] * 5
    stats = signed.stats()
    assert (stats.hits, stats.misses, stats.forged, stats.corrupt) == (1, 5, 5, 0)
    assert (stats.unsigned, stats.unknown_key, stats.bad_mac, stats.expired) == (3, 1, 1, 0)


def test_rotation_and_the_migration_window_through_the_store(
    mooncake_master_session: MasterProcess, raw_store: MooncakeDistributedStore
) -> None:
    old, new = hashlib.sha256(b"before the rotation").digest(), hashlib.sha256(b"after").digest()
    t_old, t_new, t_plain = torch.randn(8), torch.randn(8), torch.randn(8)
    cfg = config(mooncake_master_session)
    with MooncakeCache(cfg, keyring=EntryKeyring.from_secrets(old)) as before:
        assert before.insert_batch([key(10)], [t_old]) == [True]
        forge(raw_store, key(12), t_plain)
        rotated = EntryKeyring.from_secrets(new, (old, LATER), migrate_until=LATER)
        with MooncakeCache(attrs.evolve(cfg, global_segment_size=0), keyring=rotated) as during:
            assert during.insert_batch([key(11)], [t_new]) == [True]
            got = during.get_embeddings([key(10), key(11), key(12)])
            wanted = (t_old, t_new, t_plain)
            assert all(t is not None and torch.equal(t, w) for t, w in zip(got, wanted, strict=True))
            assert before.get_embeddings([key(11)]) == [None]  # not yet given the new secret
            assert before.stats().forged == before.stats().unknown_key == 1
            assert during.stats().unsigned_served == 1


def test_a_forged_far_entry_never_reaches_or_displaces_the_near_tier(
    signed: MooncakeCache, raw_store: MooncakeDistributedStore
) -> None:
    genuine, far_only, evil = torch.randn(16, 64), torch.randn(16, 64), torch.full((16, 64), 666.0)
    entry_bytes = entry_size(key(20).to_key(), genuine, keyring=RING)
    near = MemoryCache(entry_bytes + entry_bytes // 2, keyring=RING)  # room for one entry only
    tiered = TieredCache(near, signed)
    try:
        assert tiered.insert_batch([key(20)], [genuine]) == [True]
        assert signed.insert_batch([key(21)], [far_only]) == [True]
        forge(raw_store, key(20), evil)  # under the key the near tier holds
        forge(raw_store, key(21), evil)  # under a key only the far tier holds
        held = dict(near._entries)
        got = tiered.get_embeddings([key(20), key(21)])
        assert got[0] is not None and torch.equal(got[0], genuine)
        assert got[1] is None
        assert tiered.prefetch([key(21)]) == 0
        assert near._entries == held  # nothing promoted, evicted or replaced
        assert near.stats().evictions == 0
        assert near.stats().forged == 0
        assert tiered.stats().forged == signed.stats().forged == 2  # the read and the prefetch
    finally:
        near.close()


def test_mooncake_cache_keeps_the_secret_out_of_sight(
    mooncake_master_session: MasterProcess,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    text = hashlib.sha256(b"mooncake test secret, never to be shown").hexdigest()
    monkeypatch.setenv(ENV_SECRET, text)
    ring = EntryKeyring.from_secrets(text)
    t = torch.randn(4)
    with MooncakeCache(config(mooncake_master_session)) as cache:
        assert cache.keyring == ring  # read from the environment when built
        assert cache.insert_batch([key(30)], [t]) == [True]
        got = cache.get_embeddings([key(30), key(31)])
        assert got[0] is not None and torch.equal(got[0], t) and got[1] is None
        shown = "\n".join(
            [repr(cache), repr(cache.stats()), repr(cache.config)]
            + [record.getMessage() for record in caplog.records]
        )
    assert text not in shown and text.encode().hex() not in shown
    assert ring.current.key_id.hex() in shown  # the control: the id is what shows


def test_tenants_do_not_isolate_keys_through_mooncake_cache(
    mooncake_master_session: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tenant_id`` reaches Mooncake's setup, and another tenant still reads the entry."""
    import mooncake.store

    tenants: list[str] = []

    class Recording(mooncake.store.MooncakeDistributedStore):
        def setup(self, *args: Any, **kwargs: Any) -> int:
            tenants.append(kwargs.get("tenant_id", "<not passed>"))
            return int(super().setup(*args, **kwargs))

    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", Recording)
    t = torch.randn(32)
    cfg = config(mooncake_master_session)
    with MooncakeCache(attrs.evolve(cfg, tenant_id="alpha"), keyring=RING) as alpha:
        assert alpha.insert_batch([key(40)], [t]) == [True]
        beta_cfg = attrs.evolve(cfg, tenant_id="beta", global_segment_size=0)
        with MooncakeCache(beta_cfg, keyring=RING) as beta:
            got = beta.get_embeddings([key(40)])[0]
            assert got is not None and torch.equal(got, t)
    assert tenants == ["alpha", "beta"]


# -- failing closed, migration windows and expiry through the store ----------------------------


def test_required_without_a_secret_refuses_to_build_a_cache(
    mooncake_master_session: MasterProcess,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name in (ENV_SECRET, "MMKEY_ENTRY_KEY_FILE", "MMKEY_ENTRY_AUTH"):
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.WARNING, "mmkey.cache.auth")
    cfg = config(mooncake_master_session, global_segment_size=0)
    with MooncakeCache(cfg) as cache:  # unset: today's behaviour, and one warning
        assert cache.keyring is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "MooncakeCache has no entry secret" in caplog.records[0].getMessage()
    monkeypatch.setenv("MMKEY_ENTRY_AUTH", "required")
    for keyring in (FROM_ENV, None):
        with pytest.raises(ValueError, match="MMKEY_ENTRY_AUTH=required: MooncakeCache over a"):
            MooncakeCache(cfg, keyring=keyring)
    monkeypatch.setenv(ENV_SECRET, SECRET.hex())
    with MooncakeCache(cfg) as cache:
        assert cache.keyring == RING


def test_migrate_serves_unsigned_entries_until_its_end(
    mooncake_master_session: MasterProcess,
    raw_store: MooncakeDistributedStore,
    signed: MooncakeCache,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(`signed` holds the segment the entry lands in.)"""
    t = torch.randn(8)
    forge(raw_store, key(50), t)  # an unsigned entry, as an older mmkey writes
    end = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    monkeypatch.setenv("MMKEY_ENTRY_AUTH", "migrate")
    monkeypatch.setenv("MMKEY_ENTRY_MIGRATE_UNTIL", end.isoformat())
    monkeypatch.setenv(ENV_SECRET, SECRET.hex())
    with MooncakeCache(config(mooncake_master_session, global_segment_size=0)) as cache:
        assert cache.keyring is not None and cache.keyring.migrate_until == end
        got = cache.get_embeddings([key(50)])[0]
        assert got is not None and torch.equal(got, t)
        out = torch.zeros(8)
        assert cache.read_into([key(50)], [out]) == [True] and torch.equal(out, t)
        assert cache.stats().unsigned_served == 2
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 7200)  # the window has ended
        assert cache.get_embeddings([key(50)]) == [None]
        stats = cache.stats()
        assert (stats.unsigned_served, stats.forged, stats.unsigned) == (2, 1, 1)


def test_an_expired_previous_secrets_entries_are_refused_and_counted_apart(
    mooncake_master_session: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = hashlib.sha256(b"a secret rotated out").digest()
    t = torch.randn(8)
    cfg = config(mooncake_master_session)
    not_after = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    with MooncakeCache(cfg, keyring=EntryKeyring.from_secrets(old)) as before:
        assert before.insert_batch([key(60)], [t]) == [True]
        rotated = EntryKeyring.from_secrets(SECRET, (old, not_after))
        with MooncakeCache(attrs.evolve(cfg, global_segment_size=0), keyring=rotated) as after:
            got = after.get_embeddings([key(60)])[0]
            assert got is not None and torch.equal(got, t)  # within its lifetime
            real = time.time
            monkeypatch.setattr(time, "time", lambda: real() + 7200)
            assert after.get_embeddings([key(60)]) == [None]
            stats = after.stats()
            assert (stats.forged, stats.expired, stats.unknown_key, stats.bad_mac) == (1, 1, 0, 0)
