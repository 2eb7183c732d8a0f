"""Against a real local master: a reader fetches no entry larger than it can use.

A value of any size can sit under a key (anyone can write one). `get_embeddings` reads at
most ``config.max_entry_size`` bytes per entry, `read_into` at most what its targets take
plus the largest header, both checked against the store's size before any transfer; and
the read slot size learns only from entries that verified.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import pytest
import torch

from mmkey import EmbeddingKey, EntryKeyring, HashScheme, Modality, MooncakeCache, mm_hash
from mmkey.cache.mooncake._staging import MIN_SLOT
from mmkey.testing.mooncake_master import MasterProcess
from tests._support import MiB, local_config, raw_client

pytestmark = pytest.mark.mooncake

RUN = uuid.uuid4().hex[:12]
RING = EntryKeyring.from_secrets(hashlib.sha256(b"bounded reads tests").digest())
JUNK = 200 * MiB


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey(f"bounded-{RUN}", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


_HOLDER = textwrap.dedent(
    """
    import sys
    from mooncake.store import MooncakeDistributedStore
    master, size, *keys = sys.argv[1:]
    store = MooncakeDistributedStore()
    mib = 1 << 20
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", int(size) + 32 * mib, int(size) + 8 * mib,
                       "tcp", "", master) == 0
    junk = b"J" * int(size)
    for k in keys:
        assert store.put(k, junk) == 0, k
    del junk
    print("ready", flush=True)
    sys.stdin.read()  # hold the segment until the test closes stdin
    store.close()
    """
)


@pytest.fixture
def junk_under_a_key(mooncake_master_session: MasterProcess) -> Iterator[list[EmbeddingKey]]:
    """A key under which another process holds a 200 MiB junk value."""
    keys = [key(1)]
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _HOLDER,
            mooncake_master_session.address,
            str(JUNK),
            *(k.to_key() for k in keys),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        yield keys
    finally:
        holder.communicate("", timeout=60)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("keyring", [RING, None], ids=["signed", "unsigned"])
def test_a_200_mib_junk_value_is_a_miss_without_being_fetched(
    mooncake_master_session: MasterProcess,
    junk_under_a_key: list[EmbeddingKey],
    keyring: EntryKeyring | None,
) -> None:
    cfg = local_config(mooncake_master_session, global_segment_size=0, timeout=10.0)
    with MooncakeCache(cfg, keyring=keyring) as cache:
        cache.get_embeddings([key(99)])  # staging and the store's own buffers, set up
        slot = cache._transport.lanes[0].staging.slots.slot
        before = rss()
        assert cache.get_embeddings(junk_under_a_key) == [None]
        targets = [torch.zeros(8, 1024)]
        assert cache.read_into(junk_under_a_key, targets) == [False]
        grown = rss() - before
        stats = cache.stats()
        assert grown < 16 * MiB, f"RSS grew {grown / MiB:.1f} MiB"
        assert all(bool((t == 0).all()) for t in targets)
        assert stats.oversized == 2
        if keyring is None:
            assert (stats.corrupt, stats.forged) == (2, 0)
        else:
            assert (stats.corrupt, stats.forged, stats.bad_mac) == (0, 2, 2)
        assert all(lane.staging.slots.slot == slot for lane in cache._transport.lanes)


def test_a_configured_maximum_bounds_get_embeddings(
    mooncake_master_session: MasterProcess,
) -> None:
    cfg = local_config(mooncake_master_session, timeout=10.0, max_entry_size=1 * MiB)
    big, small = torch.randn(512, 1024), torch.randn(16, 16)  # 2 MiB and 1 KiB payloads
    with MooncakeCache(cfg, keyring=RING) as cache:
        assert cache.insert_batch([key(10), key(11)], [big, small]) == [True, True]
        got = cache.get_embeddings([key(10), key(11)])
        assert got[0] is None and got[1] is not None and torch.equal(got[1], small)
        assert cache.stats().oversized == 1
        out = torch.zeros(512, 1024)  # read_into is bounded by its target, not the maximum
        assert cache.read_into([key(10)], [out]) == [True]
        assert torch.equal(out, big)


def test_the_read_slot_learns_only_from_entries_that_verified(
    mooncake_master_session: MasterProcess,
) -> None:
    cfg = local_config(mooncake_master_session, timeout=10.0)
    with (
        MooncakeCache(cfg, keyring=RING) as cache,
        raw_client(local_config(mooncake_master_session, global_segment_size=0)) as stranger,
    ):
        lanes = cache._transport.lanes
        assert stranger.upsert(key(20).to_key(), b"J" * (4 * MiB)) == 0  # junk, within bounds
        assert cache.get_embeddings([key(20)]) == [None]
        assert cache.stats().forged == 1
        assert {lane.staging.slots.slot for lane in lanes} == {MIN_SLOT}  # did not grow
        genuine = torch.randn(1024, 1024)  # 4 MiB: the control
        assert cache.insert_batch([key(21)], [genuine]) == [True]
        got = cache.get_embeddings([key(21)])[0]
        assert got is not None and torch.equal(got, genuine)
        assert lanes[0].staging.slots.slot > 4 * MiB


@pytest.mark.parametrize("keyring", [RING, None], ids=["signed", "unsigned"])
def test_an_entry_past_its_own_bound_is_not_handed_over_from_a_shared_batch(
    mooncake_master_session: MasterProcess, keyring: EntryKeyring | None
) -> None:
    # One batch read, two keys of different bounds: the slot fits the larger key's target,
    # so the small key's 64 KiB entry arrives in full; it is still larger than its own
    # target can take, so it must be counted oversized and never decoded.
    cfg = local_config(mooncake_master_session, timeout=10.0)
    small_key, large_key = key(30), key(31)
    entry, wanted = torch.randn(64, 256), torch.randn(64, 256)
    with MooncakeCache(cfg, keyring=keyring) as cache:
        assert cache.insert_batch([small_key, large_key], [entry, wanted]) == [True, True]
        small, large = torch.zeros(4, 4), torch.zeros(64, 256)
        assert cache.read_into([small_key, large_key], [small, large]) == [False, True]
        assert torch.equal(large, wanted) and bool((small == 0).all())
        stats = cache.stats()
        assert stats.oversized == 1
        if keyring is None:
            assert (stats.corrupt, stats.forged) == (1, 0)
        else:
            assert (stats.corrupt, stats.forged, stats.bad_mac) == (0, 1, 1)
