"""MMKeyEmbeddingStore through SGLang's own classes, against a real local mooncake_master.

Runs in SGLang's environment (``make test-sglang``); skips elsewhere unless
MMKEY_REQUIRE_SGLANG=1.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests._support import ROOMY_TIMEOUT, local_config, raw_client
from tests.integrations.sglang.sglang_support import (
    fetch,
    fill,
    publish,
    require_sglang,
    unpinned_controller,
    wait_until,
)

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.embedding_cache_controller import EmbeddingCacheController  # noqa: E402
from sglang.srt.mem_cache.embedding_store import EmbeddingStore, EmbeddingStoreFactory  # noqa: E402
from sglang.srt.multimodal.modality import Modality as SGLangModality  # noqa: E402

from mmkey import HashScheme, Modality, MooncakeConfig  # noqa: E402
from mmkey.integrations.sglang import MMKeyEmbeddingStore, SGLangConfigError  # noqa: E402
from mmkey.integrations.sglang._recent import RecentlyPresent  # noqa: E402
from mmkey.testing.mooncake_master import MasterProcess  # noqa: E402

pytestmark = pytest.mark.mooncake

TIMEOUT = 0.4
BOUND = TIMEOUT + 2.0  # scheduling noise on a loaded machine, never a store hang (30 s)
DIMS = {"image": 64, "audio": 32}
DTYPE = torch.bfloat16
NAMESPACE = "qwen2.5-vl-7b@rev1"


def config(master: MasterProcess, **overrides: object) -> MooncakeConfig:
    """A roomy deadline, so that only a hang fails a test on a crowded host; the tests that
    kill or pause their master ask for `TIMEOUT`."""
    return local_config(master, **{"timeout": ROOMY_TIMEOUT, **overrides})


@pytest.fixture
def make_store(mooncake_master_session: MasterProcess) -> Iterator[Callable[..., MMKeyEmbeddingStore]]:
    made: list[MMKeyEmbeddingStore] = []

    def make(
        namespace: str = NAMESPACE, master: MasterProcess | None = None, **overrides: object
    ) -> MMKeyEmbeddingStore:
        cfg = config(master or mooncake_master_session, **overrides)
        store = MMKeyEmbeddingStore(namespace=namespace, config=cfg)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@contextlib.contextmanager
def two_encoders(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> Iterator[
    tuple[MMKeyEmbeddingStore, EmbeddingCacheController, MMKeyEmbeddingStore, EmbeddingCacheController]
]:
    """Two encode servers of one fleet: a writer and a reader, each SGLang's controller on a
    store of its own (``writer_store, writer, reader_store, reader``)."""
    writer_store, reader_store = make_store(), make_store()
    with (
        unpinned_controller(writer_store, DIMS, DTYPE) as writer,
        unpinned_controller(reader_store, DIMS, DTYPE) as reader,
    ):
        yield writer_store, writer, reader_store, reader


def embedding(tokens: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


# -- SGLang's factory and classes -------------------------------------------------------------


def test_is_an_sglang_embedding_store(make_store: Callable[..., MMKeyEmbeddingStore]) -> None:
    assert issubclass(MMKeyEmbeddingStore, EmbeddingStore)
    store = make_store()
    assert isinstance(store, EmbeddingStore)
    assert store.get_key("42") == "mmk1@qwen2.5-vl-7b%40rev1@image@sglang@000000000000002a"


def test_factory_creates_it_from_the_environment(
    mooncake_master_session: MasterProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import mmkey.integrations.sglang._store as integration

    monkeypatch.setattr(integration, "_started", False)
    monkeypatch.setattr(EmbeddingStoreFactory, "_registry", dict(EmbeddingStoreFactory._registry))
    monkeypatch.setenv("MMKEY_NAMESPACE", "factory-model")
    monkeypatch.setenv("MOONCAKE_MASTER", mooncake_master_session.address)
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "16MB")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "16MB")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv("MMKEY_TIMEOUT", "1.5")
    EmbeddingStoreFactory.register_backend("mmkey", "mmkey.integrations.sglang", "MMKeyEmbeddingStore")
    with caplog.at_level(logging.INFO, logger="mmkey.integrations.sglang"):
        store = EmbeddingStoreFactory.create_backend("mmkey")
        EmbeddingStoreFactory.create_backend("mmkey").close()  # type: ignore[attr-defined]
    starts = [r.getMessage() for r in caplog.records if "mmkey SGLang store:" in r.getMessage()]
    assert len(starts) == 1  # the effective configuration, once per process
    assert (
        f"namespace=factory-model hashes=sglang master={mooncake_master_session.address} protocol=tcp"
        in starts[0]
    )
    assert "(from environment)" in starts[0]
    try:
        assert isinstance(store, MMKeyEmbeddingStore)
        assert store.namespace == "factory-model"
        assert store.cache.config.master_server_address == mooncake_master_session.address
        assert store.cache.config.timeout == 1.5
        assert store.cache.is_connected()
    finally:
        store.close()  # type: ignore[attr-defined]


def test_missing_namespace_is_a_startup_error_naming_the_variable(
    mooncake_master_session: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MMKEY_NAMESPACE", raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER", mooncake_master_session.address)
    with pytest.raises(ValueError, match="MMKEY_NAMESPACE"):
        MMKeyEmbeddingStore()


# -- SGLang's EmbeddingCacheController over the store --------------------------------------------


def test_paged_round_trip_through_sglang_controllers(make_store: Callable[..., MMKeyEmbeddingStore]) -> None:
    image = SGLangModality.IMAGE
    with two_encoders(make_store) as (writer_store, writer, reader_store, reader):
        pool = writer.vision_pool
        # fragment the writer's pool so one embedding spans two page runs
        fillers = [f"{9000 + i}" for i in range(pool.num_pages)]
        for i, h in enumerate(fillers):
            fill(writer, h, embedding(pool.page_size, 64, i), image)
        with writer.lock:
            for h in (fillers[1], fillers[3]):
                pool.allocator.free(writer.entries.pop(h).page_runs)
        wide = str(2**100 + 7)  # a 128-bit-style hash: an identifier key, never truncated
        tokens = pool.page_size + 5
        expected = {"123456789": embedding(tokens, 64, 100), wide: embedding(300, 64, 101)}
        fill(writer, "123456789", expected["123456789"], image)  # lands in the two holes
        assert [(r.start, r.length) for r in writer.entries["123456789"].page_runs] == [(1, 1), (3, 1)]
        with writer.lock:
            pool.allocator.free(writer.entries.pop(fillers[5]).page_runs)
        fill(writer, wide, expected[wide], image)
        publish(writer, list(expected), image)

        # the audio pool has its own keys: an image entry never lands there
        assert fetch(reader, ["123456789"], [tokens], SGLangModality.AUDIO) == [None]
        got = fetch(reader, list(expected), [t.shape[0] for t in expected.values()], image)
        for t, g in zip(expected.values(), got, strict=True):
            assert g is not None and torch.equal(g, t)
    stats = reader_store.stats()
    assert (stats.hits, stats.misses, stats.corrupt) == (2, 1, 0)


WRITES = (
    "batch_put_from_multi_buffers",
    "batch_put_from_multi_buffer_ranges",
    "batch_upsert_from",
    "upsert_from",
    "put_from",
)
"""The binding's calls that send entries' bytes to the store (one key list each, but ``upsert_from``
and ``put_from``, one key)."""


def count_writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, stores made by `MooncakeCache` record each key their binding sends bytes
    for (any of `WRITES`): the list gets the call's name once per key."""
    import mooncake.store

    calls: list[str] = []
    real = mooncake.store.MooncakeDistributedStore

    def counted(name: str) -> Callable[..., object]:
        write = getattr(real, name)

        def call(self: object, keys: object, *args: object, **kwargs: object) -> object:
            calls.extend([name] * (len(keys) if isinstance(keys, list) else 1))
            return write(self, keys, *args, **kwargs)

        return call

    class Counting(real):  # type: ignore[misc, valid-type]
        pass

    for name in WRITES:
        setattr(Counting, name, counted(name))
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", Counting)
    return calls


def look_together(monkeypatch: pytest.MonkeyPatch, racers: int) -> threading.Event:
    """From now on, stores made by `MooncakeCache` hold the answer of their first
    ``batch_is_exist`` after the returned event is set until `racers` stores have theirs:
    every racer has seen an image absent before any of them writes it."""
    import mooncake.store

    armed = threading.Event()
    everyone = threading.Barrier(racers, timeout=60)  # a broken barrier fails the test, never hangs it
    looked: set[int] = set()
    lock = threading.Lock()
    real = mooncake.store.MooncakeDistributedStore

    class Together(real):  # type: ignore[misc, valid-type]
        def batch_is_exist(self, keys: list[str]) -> object:
            answer = super().batch_is_exist(keys)
            with lock:
                first = armed.is_set() and id(self) not in looked
                looked.add(id(self))
            if first:
                everyone.wait()
            return answer

    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", Together)
    return armed


def test_puts_go_straight_from_the_pool_pages_and_an_entry_held_already_is_kept(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = count_writes(monkeypatch)
    image = SGLangModality.IMAGE
    trusted = functools.partial(make_store, trusted_network=True)  # pools registered only then
    with two_encoders(trusted) as (writer_store, writer, reader_store, reader):
        pool = writer.vision_pool
        region = writer_store.cache._transport.region_of(pool.tensor.data_ptr(), 1)
        assert region is not None and region.tensor is pool.tensor  # registered with Mooncake
        expected = {str(700 + i): embedding(2 * pool.page_size + 3, 64, 700 + i) for i in range(3)}
        for h, t in expected.items():
            fill(writer, h, t, image)
        publish(writer, list(expected), image)
        # header and pool pages of each in one put session's ranged put
        assert writes == ["batch_put_from_multi_buffer_ranges"] * 3
        got = fetch(reader, list(expected), [t.shape[0] for t in expected.values()], image)
        assert all(g is not None and torch.equal(g, t) for g, t in zip(got, expected.values(), strict=True))
        # another encoder of the fleet encoded the same image meanwhile: its put is kept out
        h = next(iter(expected))
        with reader.lock:
            reader._evict_entry(h)
        fill(reader, h, expected[h], image)
        publish(reader, [h], image)
        assert len(writes) == 3  # nothing written: the held entry verified
        assert reader_store.stats().skipped == 1


PATIENT = 5.0
"""The timeout of tests about what is written, not how fast: a loaded machine never turns a
put into a miss there."""


RACERS = 4
RACE_TIMEOUT = 30.0
"""The racers' deadline: far past the wait for the slowest racer's lookup on a crowded host."""


@pytest.mark.parametrize("trusted", [False, True], ids=["staged", "from-pool-pages"])
def test_racing_encoders_write_one_image_once(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch, trusted: bool
) -> None:
    writes = count_writes(monkeypatch)
    together = look_together(monkeypatch, RACERS)
    stores = [make_store(timeout=RACE_TIMEOUT, trusted_network=trusted) for _ in range(RACERS)]
    pages_of = [pages(store, 30) for store in stores]
    image = embedding(30, 64, 123)
    for pool, _, _ in pages_of:
        pool[:30] = image  # the same image, encoded by each
    start = threading.Barrier(RACERS, timeout=60)

    def put(i: int) -> list[bool]:
        start.wait()
        return stores[i].batch_put_from_multi_buffers(["321"], pages_of[i][1], pages_of[i][2])

    together.set()  # each racer sees the image absent before any writes it
    with concurrent.futures.ThreadPoolExecutor(RACERS) as racing:
        results = list(racing.map(put, range(RACERS)))
    assert results == [[True]] * RACERS  # stored, or kept as another racer stores it
    assert len(writes) == 1  # the first writer wins; the others write nothing
    assert sorted(store.stats().skipped for store in stores) == [0] + [1] * (RACERS - 1)
    assert sum(store.stats().inserts for store in stores) == 1
    for store, (pool, ptrs, sizes) in zip(stores, pages_of, strict=True):
        pool.zero_()
        assert store.batch_get_into_multi_buffers(["321"], ptrs, sizes) == [True]
        assert torch.equal(pool[:30], image)  # the one entry, verified, read by every racer
    assert stores[0].batch_put_from_multi_buffers(["321"], pages_of[0][1], pages_of[0][2]) == [True]
    assert len(writes) == 1  # a later put of a held entry writes nothing


def test_an_entry_held_already_that_does_not_verify_is_replaced(
    make_store: Callable[..., MMKeyEmbeddingStore], mooncake_master_session: MasterProcess
) -> None:
    writer, reader = make_store(), make_store()
    src, ptrs, sizes = pages(writer, 16)
    src[:16] = embedding(16, 64, 9)
    key = writer.get_key("99")
    with raw_client(local_config(mooncake_master_session, global_segment_size=0)) as raw:
        assert raw.put(key, b"not an mmkey entry") == 0
        assert writer.batch_put_from_multi_buffers(["99"], ptrs, sizes) == [True]
    dst, ptrs, sizes = pages(reader, 16)
    assert reader.batch_get_into_multi_buffers(["99"], ptrs, sizes) == [True]
    assert torch.equal(dst[:16], src[:16])


def test_only_the_process_that_does_store_io_connects(
    mooncake_master_session: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MMKeyEmbeddingStore(namespace=NAMESPACE, config=config(mooncake_master_session), tp_rank=1)
    try:
        assert not store.does_io
        with pytest.raises(RuntimeError, match="no store I/O"):
            _ = store.cache
        pool = torch.zeros(64, 64, dtype=DTYPE)
        store.register_buffer(pool)  # recorded, never registered with Mooncake
        assert store.batch_is_exist(["1"]) == [False]
        assert store.batch_put_from_multi_buffers(["1"], [[pool.data_ptr()]], [[64 * 64 * 2]]) == [False]
    finally:
        store.close()
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=2):  # as SGLang's encoder sets it in a TP rank
        assert not MMKeyEmbeddingStore(namespace=NAMESPACE, config=config(mooncake_master_session)).does_io


def test_audio_pool_round_trip_and_exists_in_any_pool(make_store: Callable[..., MMKeyEmbeddingStore]) -> None:
    audio = SGLangModality.AUDIO
    with two_encoders(make_store) as (writer_store, writer, reader_store, reader):
        clip = embedding(700, 32, 7)
        fill(writer, "77", clip, audio)
        publish(writer, ["77"], audio)
        assert reader_store.batch_is_exist(["77", "78"]) == [True, False]
        assert (
            writer_store.key_for("77", Modality.AUDIO).to_key().startswith("mmk1@qwen2.5-vl-7b%40rev1@audio@")
        )
        got = fetch(reader, ["77"], [700], audio)
        assert got[0] is not None and torch.equal(got[0], clip)


def test_lookups_ask_one_key_for_a_hash_whose_pool_is_known(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    vision, audio = torch.zeros(64, 64, dtype=DTYPE), torch.zeros(64, 32, dtype=DTYPE)
    store.register_buffer(vision)
    store.register_buffer(audio)
    asked = count_store_lookups(store, monkeypatch)
    assert store.batch_is_exist(["51"]) == [False]
    assert asked == [2]  # never moved here: the key of each pool, in one call
    vision[:4] = embedding(4, 64, 51)
    assert store.batch_put_from_multi_buffers(["51"], [[vision.data_ptr()]], [[4 * 64 * 2]]) == [True]
    asked.clear()
    assert store.batch_is_exist(["51", "52"]) == [True, False]
    assert asked == [3]  # one key for the hash put from the vision pool, two for the other


def count_store_lookups(store: MMKeyEmbeddingStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of keys of each lookup the store's cache sends to the master."""
    asked: list[int] = []
    real = store.cache._exist_texts

    def counted(texts: list[str]) -> list[bool]:
        asked.append(len(texts))
        return real(texts)

    monkeypatch.setattr(store.cache, "_exist_texts", counted)
    return asked


def frozen_memory(store: MMKeyEmbeddingStore, now: list[float]) -> None:
    """Give the store's memory of yes answers a clock that moves only when the test moves it
    (a loaded machine can take longer than the one-second hold between two steps)."""
    store._recent = RecentlyPresent(1.0, 8192, clock=lambda: now[0])


def test_a_recent_yes_is_answered_from_memory_until_it_expires(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    store = make_store()
    frozen_memory(store, now)
    pool, ptrs, sizes = pages(store, 8)
    pool[:8] = embedding(8, 64, 61)
    asked = count_store_lookups(store, monkeypatch)
    assert store.batch_is_exist(["61"]) == [False]
    assert store.batch_put_from_multi_buffers(["61"], ptrs, sizes) == [True]
    asked.clear()
    assert store.batch_is_exist(["61"]) == [True]  # the put's yes: no store call
    assert store.batch_is_exist(["61", "62"]) == [True, False]  # one not remembered: all asked
    assert asked == [2]
    now[0] += 0.9
    assert store.batch_is_exist(["61"]) == [True] and asked == [2]  # the store's yes of 0.9 s ago
    now[0] += 1.0
    assert store.batch_is_exist(["61"]) == [True] and asked == [2, 1]  # expired: asked again
    store.close()
    assert store.batch_is_exist(["61"]) == [False]  # a closed store remembers nothing


def test_an_entry_removed_behind_a_remembered_yes_is_a_miss_and_forgotten(
    make_store: Callable[..., MMKeyEmbeddingStore],
    mooncake_master_session: MasterProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writer, reader = make_store(), make_store()
    frozen_memory(reader, [0.0])
    src, ptrs, sizes = pages(writer, 20)
    src[:20] = embedding(20, 64, 63)
    assert writer.batch_put_from_multi_buffers(["63"], ptrs, sizes) == [True]
    dst, dst_ptrs, dst_sizes = pages(reader, 20)
    assert reader.batch_is_exist(["63"]) == [True]
    with raw_client(local_config(mooncake_master_session, global_segment_size=0)) as raw:
        assert raw.remove(writer.get_key("63"), True) == 0
    asked = count_store_lookups(reader, monkeypatch)
    assert reader.batch_is_exist(["63"]) == [True] and asked == []  # stale, from memory
    assert reader.batch_get_into_multi_buffers(["63"], dst_ptrs, dst_sizes) == [False]  # SGLang: a miss
    assert not dst.any()
    assert reader.batch_is_exist(["63"]) == [False] and asked == [1]  # the failed read forgot it


def test_a_call_that_raises_forgets_every_remembered_yes(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    frozen_memory(store, [0.0])
    pool, ptrs, sizes = pages(store, 10)
    pool[:10] = embedding(10, 64, 71)
    assert store.batch_put_from_multi_buffers(["71"], ptrs, sizes) == [True]
    asked = count_store_lookups(store, monkeypatch)
    assert store.batch_is_exist(["71"]) == [True] and asked == []

    def broken(*args: object) -> list[bool]:
        raise RuntimeError("a fault inside the store's client")

    monkeypatch.setattr(store.cache, "read_into", broken)
    assert store.batch_get_into_multi_buffers(["72"], ptrs, sizes) == [False]  # another hash
    assert store.batch_is_exist(["71"]) == [True] and asked == [1]  # asked the store again


def test_answers_for_another_number_of_keys_are_misses_for_every_hash(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    frozen_memory(store, [0.0])
    pool, ptrs, sizes = pages(store, 10)
    pool[:10] = embedding(10, 64, 73)
    assert store.batch_put_from_multi_buffers(["73"], ptrs, sizes) == [True]
    store._recent.clear()  # every lookup below asks the cache
    errors = store.stats().errors
    real = store.cache._exist_texts
    # one answer short: which hash each answer belongs to is unknown, so none is trusted
    monkeypatch.setattr(store.cache, "_exist_texts", lambda texts: real(texts)[:-1])
    assert store.batch_is_exist(["73", "74"]) == [False, False]
    assert store.batch_is_exist(["73"]) == [False]  # a hash whose one key is known
    monkeypatch.setattr(store.cache, "read_into", lambda keys, targets: [True] * (len(keys) + 1))
    assert store.batch_get_into_multi_buffers(["73"], ptrs, sizes) == [False]
    assert store.stats().errors == errors + 3


def test_a_remembered_yes_over_a_dead_master_is_a_miss_never_an_embedding(
    mooncake_master: MasterProcess, make_store: Callable[..., MMKeyEmbeddingStore]
) -> None:
    store = make_store(master=mooncake_master, timeout=TIMEOUT)
    frozen_memory(store, [0.0])
    pool, ptrs, sizes = pages(store, 30)
    pool[:30] = embedding(30, 64, 64)
    assert store.batch_put_from_multi_buffers(["64"], ptrs, sizes) == [True]
    pool[:30] = 0  # the pages SGLang reads into
    mooncake_master.kill()
    assert store.batch_is_exist(["64"]) == [True]  # remembered: no wait on the dead master
    result, took = timed(lambda: store.batch_get_into_multi_buffers(["64"], ptrs, sizes))
    assert result == [False] and took < BOUND
    assert not pool.any()
    result, took = timed(lambda: store.batch_is_exist(["64"]))
    assert result == [False] and took < BOUND  # forgotten after the failed read: the store says no


# -- what never verifies ------------------------------------------------------------------------


def pages(
    store: MMKeyEmbeddingStore, tokens: int, dim: int = 64
) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """A registered vision pool and one run of `tokens` rows at its start."""
    pool = torch.zeros(4096, dim, dtype=DTYPE)
    store.register_buffer(pool)
    return pool, [[pool.data_ptr()]], [[tokens * dim * pool.element_size()]]


def test_corrupted_stored_bytes_are_a_counted_miss(
    make_store: Callable[..., MMKeyEmbeddingStore], mooncake_master_session: MasterProcess
) -> None:
    writer, reader = make_store(), make_store()
    src, ptrs, sizes = pages(writer, 100)
    src[:100] = embedding(100, 64, 1)
    assert writer.batch_put_from_multi_buffers(["5"], ptrs, sizes) == [True]
    key = writer.get_key("5")
    with raw_client(local_config(mooncake_master_session, global_segment_size=0)) as raw:
        entry = bytearray(raw.get(key))
        entry[-3] ^= 0x40  # one bit of the payload
        assert raw.upsert(key, bytes(entry)) == 0
    dst, ptrs, sizes = pages(reader, 100)
    assert reader.batch_get_into_multi_buffers(["5"], ptrs, sizes) == [False]
    assert reader.stats().corrupt == 1
    assert not dst.any()  # nothing that failed verification reached SGLang's pages


def test_entry_of_another_namespace_is_a_miss_and_never_served(
    make_store: Callable[..., MMKeyEmbeddingStore], mooncake_master_session: MasterProcess
) -> None:
    ours, theirs = make_store("model-a"), make_store("model-b")
    src, ptrs, sizes = pages(theirs, 10)
    src[:10] = embedding(10, 64, 2)
    assert theirs.batch_put_from_multi_buffers(["6"], ptrs, sizes) == [True]
    dst, ptrs, sizes = pages(ours, 10)
    assert ours.batch_is_exist(["6"]) == [False]
    assert ours.batch_get_into_multi_buffers(["6"], ptrs, sizes) == [False]
    # their entry copied under our key: the key echo in the entry refuses it
    with raw_client(local_config(mooncake_master_session, global_segment_size=0)) as raw:
        assert raw.upsert(ours.get_key("6"), raw.get(theirs.get_key("6"))) == 0
    assert ours.batch_get_into_multi_buffers(["6"], ptrs, sizes) == [False]
    assert ours.stats().corrupt == 1
    assert not dst.any()


def test_entry_that_does_not_fit_the_pages_is_a_counted_miss(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    writer, reader = make_store(), make_store()
    src, ptrs, sizes = pages(writer, 20, dim=64)
    src[:20] = embedding(20, 64, 3)
    assert writer.batch_put_from_multi_buffers(["8"], ptrs, sizes) == [True]
    dst, ptrs, sizes = pages(reader, 40, dim=32)  # same bytes, another shape
    assert reader.batch_get_into_multi_buffers(["8"], ptrs, sizes) == [False]
    assert reader.stats().corrupt == 1
    assert not dst.any()


def test_bad_hash_text_and_unknown_memory_are_misses_not_exceptions(
    make_store: Callable[..., MMKeyEmbeddingStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store()
    pool, ptrs, sizes = pages(store, 4)
    elsewhere = torch.zeros(4, 64, dtype=DTYPE)
    with caplog.at_level(logging.ERROR, logger="mmkey.integrations.sglang"):
        assert store.batch_is_exist(["12", "012", "-3", "abc"]) == [False] * 4
        assert store.batch_put_from_multi_buffers(["", "10"], ptrs * 2, [[8 * 64 * 2]] + sizes) == [
            False,
            True,
        ]
        assert store.batch_get_into_multi_buffers(["10"], [[elsewhere.data_ptr()]], sizes) == [False]
        assert store.batch_get_into_multi_buffers(["10", "10"], ptrs, sizes) == [
            False,
            False,
        ]  # lengths differ
    assert "must not be empty" in caplog.text
    assert "no registered pool" in caplog.text
    assert store.stats().skipped >= 2


@pytest.mark.parametrize("text", ["012", "-3", "a caller's hash: cat.png", "0x1f", str(2**200)])
def test_any_hash_text_round_trips_under_an_identifier_key(
    make_store: Callable[..., MMKeyEmbeddingStore], text: str
) -> None:
    writer, reader = make_store(timeout=PATIENT), make_store(timeout=PATIENT)
    src, ptrs, sizes = pages(writer, 8)
    src[:8] = embedding(8, 64, 8)
    assert writer.batch_put_from_multi_buffers([text], ptrs, sizes) == [True]
    assert "@id@" in writer.get_key(text)
    dst, ptrs, sizes = pages(reader, 8)
    assert reader.batch_is_exist([text]) == [True]
    assert reader.batch_get_into_multi_buffers([text], ptrs, sizes) == [True]
    assert torch.equal(dst[:8], src[:8])


# -- a master that hangs or dies -----------------------------------------------------------------


def timed(fn: Callable[[], list[bool]]) -> tuple[list[bool], float]:
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


def every_call(
    store: MMKeyEmbeddingStore, ptrs: list[list[int]], sizes: list[list[int]]
) -> list[Callable[[], list[bool]]]:
    return [
        lambda: store.batch_is_exist(["1", "2"]),
        lambda: store.batch_get_into_multi_buffers(["1"], ptrs, sizes),
        lambda: store.batch_put_from_multi_buffers(["3"], ptrs, sizes),
        lambda: store.batch_get(["1"], ptrs[0], sizes[0]),
        lambda: store.batch_put(["4"], ptrs[0], sizes[0]),
    ]


@pytest.mark.realtime
@pytest.mark.parametrize("fault", ["hung", "dead"])
def test_every_call_returns_false_within_the_deadline_when_the_master_fails(
    fault: str, mooncake_master: MasterProcess, make_store: Callable[..., MMKeyEmbeddingStore]
) -> None:
    store = make_store(master=mooncake_master, timeout=TIMEOUT)
    pool, ptrs, sizes = pages(store, 50)
    assert store.batch_put_from_multi_buffers(["1"], ptrs, sizes) == [True]
    if fault == "hung":
        mooncake_master.pause()
    else:
        mooncake_master.kill()
    try:
        for _ in range(2):
            for call in every_call(store, ptrs, sizes):
                result, took = timed(call)
                assert not any(result)
                assert took < BOUND, f"{took:.2f} s"
    finally:
        if fault == "hung":
            mooncake_master.resume()
    assert store.stats().errors >= 1


def test_controller_io_thread_is_never_stalled_by_a_hung_master(
    mooncake_master: MasterProcess, make_store: Callable[..., MMKeyEmbeddingStore]
) -> None:
    store = make_store(master=mooncake_master, timeout=TIMEOUT)
    with unpinned_controller(store, DIMS, DTYPE) as controller:
        mooncake_master.pause()
        try:
            start = time.monotonic()
            controller.prefetch("req", ["1", "2"], [10, 10], SGLangModality.IMAGE)
            assert wait_until(lambda: controller.check_prefetch_progress("req"), BOUND)
            assert time.monotonic() - start < BOUND
            assert not controller.has_local_embedding("1")
        finally:
            mooncake_master.resume()


# -- the rest of the surface --------------------------------------------------------------------


def test_single_buffer_calls_and_explicit_pool_modality(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    writer, reader = make_store(), make_store()
    video = torch.zeros(256, 64, dtype=DTYPE)
    writer.register_pool(video, Modality.VIDEO)
    video[:30] = embedding(30, 64, 4)
    size = 30 * 64 * video.element_size()
    assert writer.batch_put(["31"], [video.data_ptr()], [size]) == [True]
    assert reader.batch_is_exist(["31"]) == [False]  # the reader's default pools are image and audio
    dst = torch.zeros(256, 64, dtype=DTYPE)
    reader.register_pool(dst, Modality.VIDEO)
    assert reader.batch_is_exist(["31"]) == [True]
    assert reader.batch_get(["31"], [dst.data_ptr() + 64 * 64 * 2], [size]) == [True]
    assert torch.equal(dst[64:94], video[:30])
    assert writer.key_for("31", Modality.VIDEO).to_key().endswith("@video@sglang@000000000000001f")


def test_problems_are_logged_at_a_limited_rate(
    make_store: Callable[..., MMKeyEmbeddingStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store()
    with caplog.at_level(logging.ERROR, logger="mmkey.integrations.sglang"):
        for _ in range(50):
            assert store.batch_is_exist([""]) == [False]
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1
    assert store.stats().skipped == 50


def test_no_master_at_start_is_a_degraded_store_not_a_hang(
    make_store: Callable[..., MMKeyEmbeddingStore], mooncake_master: MasterProcess
) -> None:
    mooncake_master.kill()
    start = time.monotonic()
    store = make_store(master=mooncake_master, timeout=TIMEOUT)
    assert time.monotonic() - start < 5.0 + BOUND  # setup_timeout plus noise, never ~90 s
    pool, ptrs, sizes = pages(store, 4)
    for call in every_call(store, ptrs, sizes):
        result, took = timed(call)
        assert not any(result) and took < BOUND
    mooncake_master.restart()
    assert wait_until(lambda: store.batch_put_from_multi_buffers(["9"], ptrs, sizes) == [True], 15)


def test_fleet_secret_from_the_environment_signs_and_checks_entries(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MMKEY_ENTRY_KEY", hashlib.sha256(b"a fleet secret").hexdigest())
    writer, reader = make_store(), make_store()
    monkeypatch.setenv("MMKEY_ENTRY_KEY", hashlib.sha256(b"another fleet").hexdigest())
    stranger = make_store()
    src, ptrs, sizes = pages(writer, 12)
    src[:12] = embedding(12, 64, 5)
    assert writer.batch_put_from_multi_buffers(["41"], ptrs, sizes) == [True]
    dst, ptrs, sizes = pages(reader, 12)
    assert reader.batch_get_into_multi_buffers(["41"], ptrs, sizes) == [True]
    assert torch.equal(dst[:12], src[:12])
    theirs, ptrs, sizes = pages(stranger, 12)
    assert stranger.batch_get_into_multi_buffers(["41"], ptrs, sizes) == [False]
    assert stranger.stats().forged == 1
    assert stranger.stats().unknown_key == 1  # the reason reaches SGLang's store counters
    assert not theirs.any()


@pytest.mark.realtime
def test_a_squatted_key_is_not_reported_stored_until_it_is_written_over(
    make_store: Callable[..., MMKeyEmbeddingStore], mooncake_master_session: MasterProcess
) -> None:
    from mmkey.cache.mooncake._reserved import RESERVED_WAIT_S

    # a call of 1 s cannot wait out the 1 s a reservation is taken for a write in progress
    store = make_store(timeout=1.0)
    src, ptrs, sizes = pages(store, 16)
    src[:16] = embedding(16, 64, 77)
    text = store.get_key("4242")
    with raw_client(local_config(mooncake_master_session, global_segment_size=0)) as squatter:
        assert squatter.batch_put_session_start([text], [4096]) == [0]  # and never writes
        first = time.monotonic()
        assert store.batch_put_from_multi_buffers(["4242"], ptrs, sizes) == [False]
        assert store.batch_is_exist(["4242"]) == [False]
        assert (store.stats().skipped, store.stats().squatted) == (0, 0)  # not an honest skip
        # the reservation wait, in real time (the fake clock's version is in test_mooncake_squat.py)
        time.sleep(max(first + RESERVED_WAIT_S - time.monotonic(), 0.0))
        assert store.batch_put_from_multi_buffers(["4242"], ptrs, sizes) == [True]  # written over
    assert store.stats().squatted == 1
    reader = make_store()
    assert reader.batch_is_exist(["4242"]) == [True]
    dst, ptrs, sizes = pages(reader, 16)
    assert reader.batch_get_into_multi_buffers(["4242"], ptrs, sizes) == [True]
    assert torch.equal(dst[:16], src[:16])


# -- pins: what the mutation pass found no test for -----------------------------------------------


def test_a_held_entry_that_does_not_fit_the_pool_is_replaced_by_a_put_that_fits(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    """A verified entry of another shape (an encoder of another width) is rewritten, not kept."""
    first, second, reader = make_store(), make_store(), make_store()
    wide, ptrs, sizes = pages(first, 20, dim=64)
    wide[:20] = embedding(20, 64, 519)
    assert first.batch_put_from_multi_buffers(["5190"], ptrs, sizes) == [True]
    narrow, ptrs, sizes = pages(second, 40, dim=32)  # the same bytes, another shape
    narrow[:40] = embedding(40, 32, 520)
    assert second.batch_put_from_multi_buffers(["5190"], ptrs, sizes) == [True]
    assert second.stats().skipped == 0  # not kept: it does not fit the pool rows
    dst, ptrs, sizes = pages(reader, 40, dim=32)
    assert reader.batch_get_into_multi_buffers(["5190"], ptrs, sizes) == [True]
    assert torch.equal(dst[:40], narrow[:40])


def test_register_pool_registers_its_memory_with_the_store_in_trusted_network_mode(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    """A pool of a known modality is registered with Mooncake as `register_buffer`'s pools are."""
    store = make_store(trusted_network=True)
    video = torch.zeros(64, 64, dtype=DTYPE)
    store.register_pool(video, Modality.VIDEO)
    region = store.cache._transport.region_of(video.data_ptr(), 1)
    assert region is not None and region.tensor is video


def test_lists_of_different_lengths_fail_the_whole_call_and_refuse_no_item(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    """Lists that do not pair up are one failed call: no item is looked at (nor counted refused)."""
    store = make_store()
    _, _, sizes = pages(store, 4)
    elsewhere = torch.zeros(4, 64, dtype=DTYPE)  # memory SGLang never registered
    before = store.stats()
    call = store.batch_get_into_multi_buffers(["3850", "3851"], [[elsewhere.data_ptr()]], sizes)
    assert call == [False, False]
    after = store.stats()
    assert (after.errors, after.skipped) == (before.errors + 1, before.skipped)


def test_a_lookup_claims_and_waits_only_for_the_hashes_it_missed(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    """A hash the store holds is neither claimed nor waited for: only the missed one counts."""
    writer, reader = make_store(claim_wait=RACE_TIMEOUT), make_store(claim_wait=0.3)
    pool, ptrs, sizes = pages(writer, 8)
    pool[:8] = embedding(8, 64, 332)
    assert writer.batch_put_from_multi_buffers(["3320"], ptrs, sizes) == [True]
    assert writer.batch_is_exist(["3321"]) == [False]  # won: the writer encodes it (and never puts)
    assert reader.batch_is_exist(["3320", "3321"]) == [True, False]  # 3321 waited for, in vain
    assert "3320" not in reader._won
    stats = reader.stats()
    assert (stats.claims_won, stats.waits_served, stats.waits_timed_out, stats.coalesced) == (0, 0, 1, 0)


def unreached_config() -> MooncakeConfig:
    """A configuration whose master is never reached (the stores below do no store I/O)."""
    return MooncakeConfig(master_server_address="127.0.0.1:1")


def test_construction_refuses_a_config_or_hash_scheme_of_the_wrong_kind() -> None:
    """A config that is not a `MooncakeConfig` and a scheme SGLang never hashes with are refused."""
    with pytest.raises(TypeError, match="config must be a MooncakeConfig, got dict"):
        MMKeyEmbeddingStore(namespace=NAMESPACE, config={"master_server_address": "m:1"}, tp_rank=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hashes must be HashScheme.SGLANG or HashScheme.BLAKE3"):
        MMKeyEmbeddingStore(namespace=NAMESPACE, config=unreached_config(), hashes=HashScheme.ID, tp_rank=1)


def test_a_store_without_store_io_refuses_a_bad_modality_and_says_so_in_its_repr() -> None:
    """``register_pool`` checks its modality; the repr of a TP rank above 0 names its role."""
    store = MMKeyEmbeddingStore(namespace=NAMESPACE, config=unreached_config(), tp_rank=1)
    with pytest.raises(TypeError, match="modality must be a Modality member"):
        store.register_pool(torch.zeros(4, 4), "video")  # type: ignore[arg-type]
    assert repr(store) == f"MMKeyEmbeddingStore(namespace={NAMESPACE!r}, no store I/O in this process)"


def test_the_plugins_errors_refuse_a_store_unless_namespace_and_config_are_both_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's construction (either argument missing) refuses; a caller giving both builds."""
    import mmkey.integrations.sglang._plugin as plugin

    monkeypatch.setattr(plugin, "_plugin_errors", ["a configuration error the plugin recorded"])
    monkeypatch.setenv("MMKEY_NAMESPACE", "from-env")
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:1")
    monkeypatch.delenv("MMKEY_SGLANG_HASH", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", raising=False)
    recorded = "a configuration error the plugin recorded"
    with pytest.raises(SGLangConfigError, match=recorded):
        MMKeyEmbeddingStore(tp_rank=1)
    with pytest.raises(SGLangConfigError, match=recorded):
        MMKeyEmbeddingStore(namespace=NAMESPACE, tp_rank=1)
    with pytest.raises(SGLangConfigError, match=recorded):
        MMKeyEmbeddingStore(config=unreached_config(), tp_rank=1)
    assert (
        MMKeyEmbeddingStore(namespace=NAMESPACE, config=unreached_config(), tp_rank=1).namespace == NAMESPACE
    )


def test_a_fresh_process_logs_the_configuration_of_its_first_store_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The store's module as a new process imports it: its first store says what it uses, once."""
    import importlib.util

    import mmkey.integrations.sglang._plugin as plugin
    import mmkey.integrations.sglang._store as store_module

    spec = importlib.util.spec_from_file_location("mmkey_fresh_sglang_store", store_module.__file__)
    assert spec is not None and spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    monkeypatch.setattr(plugin, "_plugin_errors", None)
    monkeypatch.setenv("MMKEY_NAMESPACE", "fresh-model")
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:1")
    monkeypatch.delenv("MMKEY_SGLANG_HASH", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", raising=False)
    with caplog.at_level(logging.INFO, logger=spec.name):
        fresh.MMKeyEmbeddingStore(tp_rank=1)
        fresh.MMKeyEmbeddingStore(tp_rank=1)
    starts = [r.getMessage() for r in caplog.records if r.name == spec.name]
    assert len(starts) == 1 and "namespace=fresh-model hashes=sglang master=127.0.0.1:1" in starts[0]


@pytest.mark.parametrize("rank", [None, True], ids=["unset", "bool"])
def test_a_runtime_context_without_an_integer_tp_rank_does_store_io(
    mooncake_master_session: MasterProcess, rank: object
) -> None:
    """A partly set up context (no integer rank) is read as rank 0, as a process outside SGLang."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=rank):
        store = MMKeyEmbeddingStore(namespace=NAMESPACE, config=config(mooncake_master_session))
    try:
        assert store.does_io
    finally:
        store.close()


def test_a_hash_of_the_audio_pool_is_found_by_every_lookup_of_a_store_that_never_moved_it(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    """The remembered lookup of a hash of unknown pool asks every pool's key, each time."""
    writer, reader = make_store(), make_store()
    for store in (writer, reader):
        store.register_buffer(torch.zeros(64, 64, dtype=DTYPE))  # the vision pool, then audio
        store.register_buffer(torch.zeros(64, 32, dtype=DTYPE))
    clip = torch.zeros(64, 32, dtype=DTYPE)
    writer.register_pool(clip, Modality.AUDIO)
    clip[:6] = embedding(6, 32, 377)
    assert writer.batch_put(["3770"], [clip.data_ptr()], [6 * 32 * 2]) == [True]
    assert reader.batch_is_exist(["3770"]) == [True]
    assert reader.batch_is_exist(["3770", "3771"]) == [True, False]  # asked again: the memo's keys


def test_a_new_store_counts_nothing() -> None:
    """Every counter starts at zero; a call a TP rank above 0 answers is one error."""
    from mmkey.cache.protocol import CacheStats

    store = MMKeyEmbeddingStore(namespace=NAMESPACE, config=unreached_config(), tp_rank=1)
    assert store.stats() == CacheStats()
    assert store.batch_is_exist(["1"]) == [False]
    assert store.stats() == CacheStats(errors=1)


def test_a_failed_call_logs_its_exception_with_the_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """`_guard`'s error line carries the exception it caught (``exc_info``), not only its text."""
    store = MMKeyEmbeddingStore(namespace=NAMESPACE, config=unreached_config(), tp_rank=1)
    with caplog.at_level(logging.ERROR, logger="mmkey.integrations.sglang"):
        assert store.batch_is_exist(["1"]) == [False]
    failed = [r for r in caplog.records if "batch_is_exist failed" in r.getMessage()]
    assert len(failed) == 1
    exc_info = failed[0].exc_info
    assert exc_info is not None and exc_info[0] is RuntimeError
    assert "does no store I/O" in str(exc_info[1])


def test_each_embedding_in_unregistered_memory_counts_one_skip_and_no_error(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    """A run SGLang never registered refuses only its own item: one skip each, a miss, no error."""
    store = make_store()
    _, _, sizes = pages(store, 4)
    elsewhere = torch.zeros(4, 64, dtype=DTYPE)  # memory SGLang never registered
    before = store.stats()
    runs = [[elsewhere.data_ptr()]] * 2
    assert store.batch_get_into_multi_buffers(["3900", "3901"], runs, sizes * 2) == [False, False]
    after = store.stats()
    assert after.skipped - before.skipped == 2
    assert (after.misses - before.misses, after.errors - before.errors) == (2, 0)
