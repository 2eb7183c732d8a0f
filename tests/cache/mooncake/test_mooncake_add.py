"""`MooncakeCache.add_from` (put-if-absent) against a real local master: of caches racing to
add one key exactly one writes it, a held key is never replaced, and faults are failures,
never hangs (an add to a hung master, timed by a fake clock, is in test_mooncake_clock.py)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, mm_hash
from mmkey.cache.mooncake import Added, MooncakeConfig
from mmkey.cache.mooncake._reserved import fill_sessions
from mmkey.cache.mooncake._writes import Writer
from mmkey.testing.mooncake_master import MasterProcess
from tests._support import ROOMY_TIMEOUT, MiB, local_config, raw_client

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

pytestmark = pytest.mark.mooncake

DIM = 64
RACERS = 4


def config(master: MasterProcess, **overrides: Any) -> MooncakeConfig:
    """A roomy deadline, so that only a hang fails a test on a crowded host."""
    return local_config(master, **{"timeout": ROOMY_TIMEOUT, **overrides})


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("add-model", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


def pool(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.fixture
def caches(mooncake_master_session: MasterProcess) -> Iterator[list[MooncakeCache]]:
    made: list[MooncakeCache] = []
    yield made
    for c in made:
        c.close()


@pytest.mark.parametrize("trusted", [False, True], ids=["staged", "from-registered-memory"])
def test_of_caches_racing_to_add_a_key_exactly_one_writes_it(
    mooncake_master_session: MasterProcess, caches: list[MooncakeCache], trusted: bool
) -> None:
    caches.extend(
        MooncakeCache(config(mooncake_master_session, trusted_network=trusted)) for _ in range(RACERS)
    )
    src = [pool(256, seed=7) for _ in caches]  # the same embedding, in each one's memory
    for c, memory in zip(caches, src, strict=True):
        c.register_memory(memory)
    start = threading.Barrier(RACERS, timeout=60)

    def add(i: int) -> list[Added]:
        start.wait()
        return caches[i].add_from([key(1)], [[src[i][:20], src[i][100:110]]])

    with ThreadPoolExecutor(RACERS) as racing:
        outcomes = sorted((o for [o] in racing.map(add, range(RACERS))), key=lambda o: o.value)
    assert outcomes == [Added.HELD] * (RACERS - 1) + [Added.STORED]
    assert sum(c.stats().inserts for c in caches) == 1
    want = torch.cat([src[0][:20], src[0][100:110]])
    for c in caches:
        [got] = c.get_embeddings([key(1)])
        assert got is not None and torch.equal(got, want)


def test_a_held_key_is_never_replaced_even_when_its_entry_does_not_verify(
    mooncake_master_session: MasterProcess, caches: list[MooncakeCache]
) -> None:
    c = MooncakeCache(config(mooncake_master_session))
    caches.append(c)
    text = key(2).to_key()
    with raw_client(local_config(mooncake_master_session, global_segment_size=0)) as raw:
        assert raw.put(text, b"not an mmkey entry") == 0
        fresh = pool(8, seed=2)
        assert c.add_from([key(2), key(3)], [fresh, [fresh[:4], fresh[4:]]]) == [Added.HELD, Added.STORED]
        assert raw.get(text) == b"not an mmkey entry"  # held: not written
        assert c.get_embeddings([key(2)]) == [None]
        assert c.insert_from([key(2)], [fresh]) == [True]  # replacing is insert_from's
    [got] = c.get_embeddings([key(2)])
    assert got is not None and torch.equal(got, fresh)
    assert c.add_from([key(3)], [pool(8, seed=3)]) == [Added.HELD]
    [kept] = c.get_embeddings([key(3)])
    assert kept is not None and torch.equal(kept, fresh)  # the first writer's entry stands


def test_an_entry_larger_than_staging_is_added_once(
    mooncake_master_session: MasterProcess, caches: list[MooncakeCache]
) -> None:
    c = MooncakeCache(config(mooncake_master_session, local_buffer_size=1 * MiB))
    caches.append(c)
    big = pool(12 * 1024, seed=4)  # 1.5 MiB: past the staging buffer, a registered buffer of its own
    assert c.add_from([key(4)], [big]) == [Added.STORED]
    assert c.add_from([key(4)], [pool(12 * 1024, seed=5)]) == [Added.HELD]
    [got] = c.get_embeddings([key(4)])
    assert got is not None and torch.equal(got, big)


class _Sessions:
    """The binding's put sessions, scripted: each ranged put writes `sent` bytes."""

    def __init__(self, sent: list[int]) -> None:
        self.sent = sent
        self.ended: list[str] = []
        self.revoked: list[str] = []

    def batch_put_session_start(self, keys: list[str], sizes: list[int], *config: object) -> list[int]:
        return [0] * len(keys)

    def batch_put_from_multi_buffer_ranges(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], offsets: list[list[int]]
    ) -> list[int]:
        assert offsets == [[0, 10], [0]]  # each buffer lands after the ones before it
        return self.sent

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        self.ended.extend(keys)
        return [0] * len(keys)

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        self.revoked.extend(keys)
        return [0] * len(keys)


def test_a_session_whose_bytes_did_not_all_land_is_revoked_never_ended() -> None:
    store = _Sessions(sent=[30, 7])  # the second wrote 7 of its 8 bytes: stale bytes would follow
    scripted = cast("MooncakeDistributedStore", store)  # the real store makes no partial write on call
    stuck: set[str] = set()
    ended = fill_sessions(scripted, ["a", "b"], [[1, 2], [3]], [[10, 20], [8]], [30, 8], stuck)
    assert ended == {"a"}
    assert (store.ended, store.revoked, stuck) == (["a"], ["b"], set())


@contextlib.contextmanager
def registered_bytes(client: MooncakeDistributedStore, data: bytes) -> Iterator[tuple[int, int]]:
    """``(pointer, size)`` of `data` in memory registered with `client`, as a lane's staging is."""
    view = (ctypes.c_char * len(data)).from_buffer(bytearray(data))
    ptr = ctypes.addressof(view)
    assert client.register_buffer(ptr, len(data)) == 0
    try:
        yield ptr, len(data)
    finally:
        assert client.unregister_buffer(ptr) == 0


class UpsertMidSession:
    """A raw client whose ranged put first lets another client upsert the key: Mooncake then
    refuses both the session's end and its revoke (-601), and keeps the session open."""

    def __init__(self, client: MooncakeDistributedStore, other: MooncakeDistributedStore) -> None:
        self._client, self._other = client, other

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def batch_put_from_multi_buffer_ranges(self, keys: list[str], *rest: Any) -> list[int]:
        for text in keys:
            assert self._other.upsert(text, b"upserted by another encoder") == 0
        return self._client.batch_put_from_multi_buffer_ranges(keys, *rest)


# These drive the cache's worker-side add (`_add_on_worker`) on raw clients of a real master,
# to hold one interleaving of two writers exactly; the racing tests above cover the rest.


@pytest.fixture
def writer(mooncake_master_session: MasterProcess, caches: list[MooncakeCache]) -> Writer:
    """The worker side of a cache of the session's master."""
    caches.append(cache := MooncakeCache(config(mooncake_master_session)))
    return cache._writer


def test_a_key_this_client_is_adding_on_another_lane_is_held_not_failed(
    mooncake_master_session: MasterProcess, writer: Writer
) -> None:
    text = key(10).to_key()
    with (
        raw_client(config(mooncake_master_session)) as client,
        registered_bytes(client, b"entry" * 20) as (ptr, n),
    ):
        assert client.batch_put_session_start([text], [n]) == [0]  # the other lane's session
        assert writer._add_on_worker(client, [text], [[ptr]], [[n]]) == {text: Added.HELD}
        assert client.batch_put_session_revoke([text]) == [0]


def test_a_session_left_open_by_an_upsert_is_revoked_and_the_key_added_once_it_is_gone(
    mooncake_master_session: MasterProcess, writer: Writer
) -> None:
    text = key(11).to_key()
    data = b"the encoder's entry" * 8
    with (
        raw_client(config(mooncake_master_session)) as client,
        raw_client(config(mooncake_master_session)) as other,
        registered_bytes(client, data) as (ptr, n),
    ):

        def add(store: MooncakeDistributedStore) -> dict[str, Added]:
            return writer._add_on_worker(store, [text], [[ptr]], [[n]])

        racing = cast("MooncakeDistributedStore", UpsertMidSession(client, other))
        assert add(racing) == {text: Added.FAILED}  # the upsert won; the session stays open
        assert text in writer._stuck
        assert add(client) == {text: Added.FAILED}  # its revoke is still refused
        assert other.get(text) == b"upserted by another encoder"
        assert other.remove(text, force=True) == 0
        assert add(client) == {text: Added.STORED}  # revoked at last, then added
        assert writer._stuck == set()
        assert other.get(text) == data


def test_a_key_remembered_as_stuck_is_forgotten_once_a_start_is_granted(
    mooncake_master_session: MasterProcess, writer: Writer
) -> None:
    # a revoke refused for a fault (not an upsert) leaves no session open: the next start is
    # granted, and the key must not stay in the writer's memory
    text = key(12).to_key()
    writer._stuck.add(text)
    with (
        raw_client(config(mooncake_master_session)) as client,
        registered_bytes(client, b"entry" * 20) as (ptr, n),
    ):
        assert writer._add_on_worker(client, [text], [[ptr]], [[n]]) == {text: Added.STORED}
    assert writer._stuck == set()
