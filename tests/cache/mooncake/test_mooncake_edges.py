"""MooncakeCache at the edges, against a real local mooncake_master: no process-wide freeze
(paused master at set-up, re-connect and close), waits that release what they hold on any
exception, one timeout per call, read slots that adapt both ways, distinct tensors for
repeated keys, foreign faults as misses, and calls that race `close`.

A thread ticking every few milliseconds measures freezes: Mooncake's setup() and close()
hold the GIL, so while one of them waits on a hung master no Python thread runs.
``faulthandler.dump_traceback_later`` turns a freeze that never ends into a failure. The two
tests that let real time pass are marked `realtime`; the read under a slow store runs on the
fake store, timed by a fake clock each store call advances.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig, mm_hash
from mmkey.cache.mooncake._net import master_answers
from mmkey.cache.mooncake._staging import MIN_SLOT, ReadSlots
from mmkey.cache.mooncake._transport import close_abandoned
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore
from mmkey.testing.mooncake_master import MasterProcess
from tests._clock import FakeClock
from tests._support import ROOMY_TIMEOUT, local_config, timed, wait_until

pytestmark = pytest.mark.mooncake

MiB = 1 << 20
TIMEOUT = 0.3
SLACK = 1.0
"""Scheduling noise on a loaded machine; a freeze behind a hung master lasts 30 s or more."""


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("edges", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


def config(master: MasterProcess, **overrides: object) -> MooncakeConfig:
    """A roomy deadline, so that only a hang fails a test on a crowded host; the tests that
    fault a master or time a store ask for `TIMEOUT`."""
    defaults = {"setup_timeout": 2.0, "retry_after": 0.1, "timeout": ROOMY_TIMEOUT}
    return local_config(master, **{**defaults, **overrides})


class Ticker:
    """A thread waking every 5 ms; `longest` is the longest it was kept from running."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.005):
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def reset(self) -> None:
        self.longest = 0.0

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def ticker() -> Iterator[Ticker]:
    faulthandler.dump_traceback_later(120, exit=True)  # a freeze that never ends fails the run
    try:
        with Ticker() as t:
            yield t
    finally:
        faulthandler.cancel_dump_traceback_later()


# -- the liveness probe -------------------------------------------------------------------


def test_the_probe_tells_a_paused_master_from_a_live_one(mooncake_master: MasterProcess) -> None:
    host, port = mooncake_master.host, mooncake_master.rpc_port
    assert master_answers(host, port, 2.0)
    mooncake_master.pause()
    try:
        answered, took = timed(lambda: master_answers(host, port, 0.3))
        assert answered is False and took < 0.3 + SLACK
    finally:
        mooncake_master.resume()
    assert master_answers(host, port, 2.0)
    mooncake_master.kill()
    assert not master_answers(host, port, 0.3)


def test_the_probe_refuses_a_server_that_is_not_a_master() -> None:
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def answer_garbage() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer_garbage, daemon=True)
        thread.start()
        assert not master_answers("127.0.0.1", port, 2.0)
        thread.join(5)


# -- no process-wide freeze ---------------------------------------------------------------


def test_construction_against_a_paused_master_never_freezes_the_process(
    mooncake_master: MasterProcess, ticker: Ticker
) -> None:
    mooncake_master.pause()
    try:
        cache, took = timed(lambda: MooncakeCache(config(mooncake_master, timeout=TIMEOUT)))
        assert isinstance(cache, MooncakeCache)
        assert took < 2.0 + SLACK and ticker.longest < TIMEOUT + SLACK
        assert not cache.is_connected()
        got, took = timed(lambda: cache.get_embeddings([key(1)]))
        assert got == [None] and took < TIMEOUT + SLACK
        cache.close()
        assert ticker.longest < TIMEOUT + SLACK
    finally:
        mooncake_master.resume()


@pytest.mark.realtime
def test_reconnecting_to_a_master_that_came_back_hung_never_freezes_the_process(
    mooncake_master: MasterProcess, ticker: Ticker
) -> None:
    mooncake_master.kill()
    cache = MooncakeCache(config(mooncake_master, timeout=TIMEOUT))
    try:
        mooncake_master.restart()
        mooncake_master.pause()
        ticker.reset()
        for _ in range(5):
            time.sleep(0.15)  # past retry_after (real time): every call tries to re-connect
            got, took = timed(lambda: cache.get_embeddings([key(2)]))
            assert got == [None] and took < TIMEOUT + SLACK
        assert ticker.longest < TIMEOUT + SLACK
        mooncake_master.resume()
        assert wait_until(lambda: cache.insert_batch([key(2)], [torch.ones(3)]) == [True], 30)
        got = cache.get_embeddings([key(2)])[0]
        assert got is not None and torch.equal(got, torch.ones(3))
    finally:
        mooncake_master.resume() if mooncake_master.paused else None
        cache.close()


@pytest.mark.realtime
def test_close_with_a_paused_master_returns_within_the_timeout_without_freezing(
    mooncake_master: MasterProcess, ticker: Ticker
) -> None:
    cache = MooncakeCache(config(mooncake_master, timeout=TIMEOUT))
    assert cache.insert_batch([key(3)], [torch.ones(4)]) == [True]
    mooncake_master.pause()
    try:
        ticker.reset()
        _, took = timed(cache.close)
        assert took < TIMEOUT + SLACK and ticker.longest < TIMEOUT + SLACK
    finally:
        mooncake_master.resume()
    time.sleep(1.0)  # the abandoned store is never closed later behind the caller's back
    assert ticker.longest < TIMEOUT + SLACK
    assert close_abandoned() == 1, "closed only when asked, once the master answers"
    assert close_abandoned() == 0


def test_close_behind_a_stuck_call_abandons_the_store_once_the_call_returns(
    mooncake_master: MasterProcess, ticker: Ticker
) -> None:
    cache = MooncakeCache(config(mooncake_master, timeout=TIMEOUT))
    assert cache.insert_batch([key(4)], [torch.ones(4)]) == [True]
    mooncake_master.pause()
    try:
        assert cache.batch_is_exist([key(4)]) == [False]  # leaves the worker stuck (30 s)
        ticker.reset()
        _, took = timed(cache.close)
        assert took < TIMEOUT + SLACK and ticker.longest < TIMEOUT + SLACK
    finally:
        mooncake_master.resume()  # the stuck call returns now; the late close must not run
    assert cache._transport.join(40)
    assert ticker.longest < TIMEOUT + SLACK
    assert close_abandoned() == 1


def test_healthy_close_freeze_is_bounded(mooncake_master: MasterProcess, ticker: Ticker) -> None:
    # Mooncake's close holds the GIL for about 1-2 s on a healthy master (documented);
    # this only catches a hang
    cache = MooncakeCache(config(mooncake_master, timeout=TIMEOUT))
    assert cache.insert_batch([key(5)], [torch.ones(4)]) == [True]
    ticker.reset()
    _, took = timed(cache.close)
    assert took < 10 and ticker.longest < 10


def test_a_process_that_abandoned_a_store_exits_once_the_master_answers(
    mooncake_master: MasterProcess,
) -> None:
    # close() returns at once; Mooncake's own threads then hold the exit until the master
    # answers or their RPCs time out (about 90 s measured with the master left paused)
    script = f"""
import sys, time, torch
from mmkey import EmbeddingKey, MooncakeCache, MooncakeConfig
cache = MooncakeCache(MooncakeConfig(master_server_address={mooncake_master.address!r},
                                     global_segment_size=64 << 20, local_buffer_size=16 << 20,
                                     timeout=0.3))
assert cache.insert_batch([EmbeddingKey.from_key(sys.argv[1])], [torch.ones(2)]) == [True]
print("ready", flush=True)
sys.stdin.readline()
start = time.monotonic()
cache.close()
print(f"closed {{time.monotonic() - start:.3f}}", flush=True)
"""
    child = subprocess.Popen(
        [sys.executable, "-c", script, key(6).to_key()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        mooncake_master.pause()
        child.stdin.write("close\n")
        child.stdin.flush()
        word, took = child.stdout.readline().split()
        assert word == "closed" and float(took) < TIMEOUT + SLACK
        mooncake_master.resume()
        assert child.wait(timeout=60) == 0
    finally:
        if mooncake_master.paused:
            mooncake_master.resume()
        if child.poll() is None:
            child.kill()
            child.wait()


# -- waits release what they hold --------------------------------------------------------


def counted_store(monkeypatch: pytest.MonkeyPatch, methods: tuple[str, ...]) -> dict[str, int]:
    """Count every new store's calls of `methods` (per method); while `store_gate` holds an
    event, each call waits for it first (a store that hangs until the test lets it go)."""
    import mooncake.store

    calls: dict[str, int] = {}
    base = mooncake.store.MooncakeDistributedStore

    def wrap(name: str) -> Callable[..., Any]:
        original = getattr(base, name)

        def counted(self: Any, *args: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            gate = store_gate[0]
            if gate is not None:
                assert gate.wait(30), "the test never let a held store call go"
            return original(self, *args)

        return counted

    subclass = type("CountedStore", (base,), {name: wrap(name) for name in methods})
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", subclass)
    return calls


store_gate: list[threading.Event | None] = [None]


def test_keyboard_interrupt_during_a_read_leaves_the_cache_usable(
    monkeypatch: pytest.MonkeyPatch, mooncake_master_session: MasterProcess
) -> None:
    counted_store(monkeypatch, ("batch_get_into",))
    gate = threading.Event()
    with MooncakeCache(config(mooncake_master_session)) as cache:
        keys = [key(100 + i) for i in range(4)]
        values = [torch.full((100,), float(i)) for i in range(4)]
        assert cache.insert_batch(keys, values) == [True] * 4
        store_gate[0] = gate  # the read's transfer waits until the interrupt came

        def interrupt(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            with pytest.raises(KeyboardInterrupt):
                cache.get_embeddings(keys)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            store_gate[0] = None
            gate.set()
        for got, want in zip(cache.get_embeddings(keys), values, strict=True):
            assert got is not None and torch.equal(got, want)
        assert cache.insert_batch([key(104)], [torch.ones(2)]) == [True]
        transport = cache._transport
    assert transport.join(5), "close() stops the workers"


def test_a_foreign_fault_on_the_worker_is_a_counted_miss(
    monkeypatch: pytest.MonkeyPatch, mooncake_master_session: MasterProcess
) -> None:
    # the real store cannot be made to raise MemoryError on demand: a subclass does
    import mooncake.store

    fail = [True]

    class FailingStore(mooncake.store.MooncakeDistributedStore):
        def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            if fail[0]:
                raise MemoryError("a huge foreign value")
            return super().batch_get_into(keys, ptrs, sizes)

        def get_size(self, key: str, /) -> int:
            return 1 << 50 if key.endswith("0" * 31 + "7") and fail[0] else super().get_size(key)

    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", FailingStore)
    with MooncakeCache(config(mooncake_master_session, retry_after=5.0)) as cache:
        assert cache.insert_batch([key(200)], [torch.ones(5)]) == [True]
        before = cache.stats()
        assert cache.get_embeddings([key(200)]) == [None]
        after = cache.stats()
        assert after.errors == before.errors + 1 and after.misses == before.misses + 1
        fail[0] = False
        assert cache.is_connected(), "not a store fault: the breaker stays closed"
        got = cache.get_embeddings([key(200)])[0]
        assert got is not None and torch.equal(got, torch.ones(5))


def test_a_value_too_large_to_allocate_is_a_counted_miss(
    monkeypatch: pytest.MonkeyPatch, mooncake_master_session: MasterProcess
) -> None:
    import mooncake.store

    class HugeSize(mooncake.store.MooncakeDistributedStore):
        def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            return [-600] * len(keys)  # every entry too large for its slot

        def get_size(self, key: str, /) -> int:
            return 1 << 50  # a petabyte: the allocation fails

    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", HugeSize)
    with MooncakeCache(config(mooncake_master_session)) as cache:
        assert cache.insert_batch([key(201)], [torch.ones(5)]) == [True]
        before = cache.stats()
        assert cache.get_embeddings([key(201)]) == [None]
        after = cache.stats()  # larger than max_entry_size: refused before any allocation
        assert (after.oversized, after.misses) == (before.oversized + 1, before.misses + 1)


def test_calls_racing_close_return_at_once(mooncake_master: MasterProcess, ticker: Ticker) -> None:
    cache = MooncakeCache(config(mooncake_master))
    assert cache.insert_batch([key(300)], [torch.ones(4)]) == [True]
    mooncake_master.pause()
    returned: list[float] = []

    def reader() -> None:
        cache.get_embeddings([key(300)])
        returned.append(time.monotonic())

    try:
        thread = threading.Thread(target=reader)
        thread.start()
        transport = cache._transport
        runners = [transport._meta, *(lane.worker for lane in transport.lanes)]
        assert wait_until(lambda: any(r.is_busy() for r in runners), 10), "the read is stuck on a worker"
        closed_at = time.monotonic()
        cache.close()
        thread.join(10)
        assert returned and returned[0] - closed_at < SLACK, "not a full 5 s timeout"
    finally:
        mooncake_master.resume()
    assert cache._transport.join(40)
    assert close_abandoned() == 1


# -- one timeout per call, slots that adapt ---------------------------------------------


def test_a_large_read_under_a_slow_store_is_bounded_by_one_timeout() -> None:
    # on the fake store, every store call of the reader takes 0.1 s of its clock, under a
    # 0.3 s timeout: the read gives up at its one timeout (20 transfers took 2 s before)
    clock = FakeClock()
    calls: dict[str, int] = {}

    class SlowStore(FakeMooncakeStore):
        def _slow(self, name: str) -> None:
            calls[name] = calls.get(name, 0) + 1
            clock.advance(0.1)

        def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
            self._slow("batch_get_into")
            return super().batch_get_into(keys, buffer_ptrs, sizes)

        def get_size(self, key: str, /) -> int:
            self._slow("get_size")
            return super().get_size(key)

        def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
            self._slow("get_into")
            return super().get_into(key, buffer_ptr, size)

    with FakeMooncakeMaster() as master:
        fields = {"master_server_address": master.address, "local_buffer_size": 1 * MiB}
        writer_config = MooncakeConfig(**fields, global_segment_size=64 * MiB, timeout=30.0)  # type: ignore[arg-type]
        reader_config = MooncakeConfig(**fields, global_segment_size=0, timeout=TIMEOUT)  # type: ignore[arg-type]
        with (
            MooncakeCache(writer_config, keyring=None, store_class=FakeMooncakeStore) as writer,
            MooncakeCache(reader_config, keyring=None, store_class=SlowStore, clock=clock) as cache,
        ):
            keys = [key(400 + i) for i in range(80)]  # 64 KiB each, 4 keys a transfer: 20 transfers
            assert writer.insert_batch(keys, [torch.randn(16 * 1024) for _ in keys]) == [True] * 80
            calls.clear()
            start = clock()
            got = cache.get_embeddings(keys)
            assert clock() - start <= TIMEOUT + 0.1 + 1e-9, "one timeout, and the call running at it"
            assert got.count(None) > 0
            assert calls["batch_get_into"] <= 5


def test_read_slots_adapt_down_after_one_large_entry(
    monkeypatch: pytest.MonkeyPatch, mooncake_master_session: MasterProcess
) -> None:
    calls = counted_store(monkeypatch, ("batch_get_into",))
    with MooncakeCache(config(mooncake_master_session, local_buffer_size=4 * MiB, timeout=30.0)) as cache:
        big = key(500)
        small = [key(501 + i) for i in range(64)]
        values = [torch.randn(16 * 1024) for _ in small]  # 64 KiB each
        assert cache.insert_batch([big, *small], [torch.randn(2 * MiB), *values]) == [True] * 65
        assert cache.get_embeddings([big])[0] is not None  # 8 MiB: the slot grows to the buffer
        per_call = []
        for _ in range(4):
            calls.clear()
            got = cache.get_embeddings(small)
            assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True))
            per_call.append(calls["batch_get_into"])
        # 4 MiB / 256 KiB slots = 16 keys a transfer once the slot is back down
        assert per_call[-1] == 64 // (4 * MiB // MIN_SLOT), per_call
        assert per_call[0] < 64, "not one key per transfer"
        assert per_call == sorted(per_call, reverse=True)


def test_read_slots_grow_at_once_and_halve_towards_smaller_entries() -> None:
    slots = ReadSlots(4 * MiB)
    assert slots.slot == MIN_SLOT and slots.keys_per_transfer() == 16
    slots.observe(3 * MiB)
    assert slots.slot == 3 * MiB and slots.keys_per_transfer() == 1
    slots.observe(64 * 1024)
    assert slots.slot == 3 * MiB // 2
    slots.observe(0)  # nothing found: no evidence either way
    assert slots.slot == 3 * MiB // 2
    for _ in range(10):
        slots.observe(64 * 1024)
    assert slots.slot == MIN_SLOT
    slots.observe(100 * MiB)
    assert slots.slot == 4 * MiB
    assert slots.slot_for(3) % 64 == 0 and 3 * slots.slot_for(3) <= 4 * MiB
    tiny = ReadSlots(4096)
    tiny.observe(10)
    assert tiny.slot == 4096 and tiny.keys_per_transfer() == 1


# -- results -----------------------------------------------------------------------------


def test_a_key_read_twice_gives_distinct_tensors(mooncake_master_session: MasterProcess) -> None:
    with MooncakeCache(config(mooncake_master_session)) as cache:
        assert cache.insert_batch([key(600)], [torch.ones(8)]) == [True]
        first, second = cache.get_embeddings([key(600), key(600)])
        assert first is not None and second is not None
        first.add_(1.0)
        assert torch.equal(second, torch.ones(8))
        assert cache.stats().hits == 2


def test_inserts_wait_for_the_callers_streams_on_the_worker(
    monkeypatch: pytest.MonkeyPatch, mooncake_master_session: MasterProcess
) -> None:
    # CUDA tensors: host_ready records an event on the caller's thread, the worker waits
    # on it before reading; the CPU part of that hand-over is checked here everywhere
    import mmkey.cache.mooncake._writes as module
    from mmkey._tensors import host_ready as real

    seen: list[tuple[str, str]] = []

    class Recorded:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def wait(self) -> None:
            seen.append(("wait", threading.current_thread().name))
            self.inner.wait()

    def recording(tensors: Any) -> Any:
        seen.append(("record", threading.current_thread().name))
        return Recorded(real(tensors))

    monkeypatch.setattr(module, "host_ready", recording)
    with MooncakeCache(config(mooncake_master_session)) as cache:
        assert cache.insert_batch([key(700)], [torch.ones(3)]) == [True]
    assert [what for what, _ in seen] == ["record", "wait"]
    assert seen[0][1] == threading.current_thread().name
    assert seen[1][1].startswith("mmkey-mooncake-transfer-")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_side_stream_output_is_stored_complete(  # pragma: no cover
    mooncake_master_session: MasterProcess,
) -> None:
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    out = torch.zeros(1 << 20, device="cuda")
    with MooncakeCache(config(mooncake_master_session, timeout=30.0)) as cache:
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # ~1 s
            out.fill_(7.0)
            assert cache.insert_batch([key(800)], [out]) == [True]
        got = cache.get_embeddings([key(800)])[0]
        assert got is not None and torch.equal(got, torch.full((1 << 20,), 7.0))


def test_overlapping_calls_into_the_binding_are_safe(
    monkeypatch: pytest.MonkeyPatch, mooncake_master_session: MasterProcess
) -> None:
    # writers, readers and lookups from six threads; the lanes call the binding at the same
    # time (measured below) and every answer is right
    import mooncake.store

    base = mooncake.store.MooncakeDistributedStore
    active = [0, 0]  # now, most at once
    lock = threading.Lock()

    def overlapping(name: str) -> Callable[..., Any]:
        original = getattr(base, name)

        def call(self: Any, *args: Any) -> Any:
            with lock:
                active[0] += 1
                active[1] = max(active[1], active[0])
            try:
                return original(self, *args)
            finally:
                with lock:
                    active[0] -= 1

        return call

    methods = ("batch_get_into", "batch_upsert_from", "batch_is_exist")
    subclass = type("Overlapping", (base,), {m: overlapping(m) for m in methods})
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", subclass)
    wrong: list[str] = []
    with MooncakeCache(config(mooncake_master_session, timeout=30.0)) as cache:

        def worker(n: int) -> None:
            keys = [key(900_000 + n * 100 + i) for i in range(20)]
            for round_ in range(15):
                values = [torch.full((4096,), float(n * 1000 + round_ * 20 + i)) for i in range(20)]
                if cache.insert_batch(keys, values) != [True] * 20:
                    wrong.append(f"insert {n}/{round_}")
                if cache.batch_is_exist(keys) != [True] * 20:
                    wrong.append(f"exists {n}/{round_}")
                for got, want in zip(cache.get_embeddings(keys), values, strict=True):
                    if got is None or not torch.equal(got, want):
                        wrong.append(f"read {n}/{round_}")

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert wrong == []
        assert cache.stats().errors == 0
    assert active[1] >= 2, "the binding never saw two calls at once"


def test_health_reports_the_breaker_and_skips_are_counted(mooncake_master: MasterProcess) -> None:
    from mmkey.cache.health import health_of

    with MooncakeCache(config(mooncake_master, retry_after=30.0, timeout=TIMEOUT)) as cache:
        assert cache.health().breaker_open is False and cache.health().quarantined == ()
        mooncake_master.kill()
        assert cache.get_embeddings([key(950)]) == [None]  # a transfer times out
        assert cache.get_embeddings([key(950)]) == [None]  # the master does not answer: open
        assert cache.get_embeddings([key(950)]) == [None]  # answered without the store
        health = health_of(cache)
        assert health is not None and health.breaker_open
        stats = cache.stats()
        assert stats.errors >= 1 and stats.skipped >= 1
        assert stats.entries is None and stats.bytes_held is None
