"""The plugin's I/O loop for SGLang's embedding cache: the same work, no polling while idle.

SGLang's own `EmbeddingCacheController` runs each test, with the hook applied through
SGLang's hook registry as the plugin applies it. Runs in SGLang's environment; skips
elsewhere unless MMKEY_REQUIRE_SGLANG=1.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import cast

import pytest

from tests._support import ROOMY_TIMEOUT, local_config, wait_until
from tests.integrations.sglang.sglang_support import fetch, fill, publish, require_sglang, unpinned_controller

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.embedding_cache_controller import (  # noqa: E402
    EmbeddingCacheController,
    EmbeddingPrefetchOperation,
)
from sglang.srt.mem_cache.embedding_store import EmbeddingStore  # noqa: E402
from sglang.srt.multimodal.modality import Modality as SGLangModality  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

import mmkey.integrations.sglang._io_loop as io_loop  # noqa: E402
from mmkey.integrations.sglang import MMKeyEmbeddingStore  # noqa: E402
from mmkey.testing.mooncake_master import MasterProcess  # noqa: E402

DIMS = {"image": 64, "audio": 32}
DTYPE = torch.bfloat16
IMAGE = SGLangModality.IMAGE
SGLANGS = {"loop": EmbeddingCacheController._io_loop}
"""SGLang's own loop, held in a dict: applying a hook rebinds every module global that names
the original function (SGLang's ``_propagate_patch``), a global of this module included."""
SGLANGS_LOGGER = EmbeddingCacheController.__module__


class MemoryStore(EmbeddingStore):
    """An embedding store in this process's memory (beside the real store's test below),
    whose calls raise while `failing` is set."""

    def __init__(self) -> None:
        self.entries: dict[str, list[bytes]] = {}
        self.failing = False

    def batch_get(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        raise NotImplementedError  # the controller's loop uses the multi-buffer calls

    def batch_put(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        raise NotImplementedError

    def batch_is_exist(self, hashes: list[str]) -> list[bool]:
        return [h in self.entries for h in hashes]

    def batch_get_into_multi_buffers(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        if self.failing:
            raise RuntimeError("the store is down")
        found = []
        for key, key_ptrs, key_sizes in zip(keys, ptrs, sizes, strict=True):
            parts = self.entries.get(key)
            if parts is None or [len(p) for p in parts] != key_sizes:
                found.append(False)
                continue
            for ptr, part in zip(key_ptrs, parts, strict=True):
                ctypes.memmove(ptr, part, len(part))
            found.append(True)
        return found

    def batch_put_from_multi_buffers(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        if self.failing:
            raise RuntimeError("the store is down")
        for key, key_ptrs, key_sizes in zip(keys, ptrs, sizes, strict=True):
            self.entries[key] = [ctypes.string_at(p, n) for p, n in zip(key_ptrs, key_sizes, strict=True)]
        return [True] * len(keys)


@pytest.fixture
def waiting(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The plugin's hook registered and applied through SGLang's registry; undone afterwards."""
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(io_loop, "_installed", False)
    monkeypatch.setattr(EmbeddingCacheController, "_io_loop", SGLANGS["loop"])
    io_loop.install()
    HookRegistry.apply_hooks()
    assert getattr(EmbeddingCacheController._io_loop, "__wrapped__", None) is SGLANGS["loop"]
    yield


def embedding(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, DIMS["image"], generator=torch.Generator().manual_seed(seed)).to(DTYPE)


def count_queue_reads(controller: EmbeddingCacheController) -> list[int]:
    """From now on, the one-item list counts the reads of the controller's prefetch queue."""
    reads = [0]
    get_nowait = controller.prefetch_queue.get_nowait

    def counted() -> EmbeddingPrefetchOperation:
        reads[0] += 1
        return get_nowait()

    controller.prefetch_queue.get_nowait = counted  # type: ignore[method-assign]
    return reads


@pytest.mark.mooncake
def test_entries_go_through_the_real_store_and_back_with_sglangs_log_lines(
    waiting: None, mooncake_master_session: MasterProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SGLANGS_LOGGER)
    stores = [
        MMKeyEmbeddingStore(
            namespace="io-loop", config=local_config(mooncake_master_session, timeout=ROOMY_TIMEOUT)
        )
        for _ in range(2)
    ]
    try:
        with (
            unpinned_controller(stores[0], DIMS, DTYPE) as writer,
            unpinned_controller(stores[1], DIMS, DTYPE) as reader,
        ):
            expected = {"11": embedding(40, 1), "12": embedding(300, 2)}
            for h, tensor in expected.items():
                fill(writer, h, tensor, IMAGE)
            publish(writer, list(expected), IMAGE)
            got = fetch(reader, [*expected, "13"], [40, 300, 7], IMAGE)
            assert [
                g is not None and torch.equal(g, t) for g, t in zip(got[:2], expected.values(), strict=True)
            ] == [
                True,
                True,
            ]
            assert got[2] is None and not reader.has_local_embedding("13")
            # SGLang's own lines, through its logger: what its operators (and the engine tests) read
            said = [r.getMessage() for r in caplog.records if r.name == SGLANGS_LOGGER]
            assert "Mooncake PUT Finished: Stored 2/2 embeddings in cluster." in said
            assert "Mooncake GET Finished: Req req, Successfully fetched 2/3 embeddings." in said
            # the loop that ran is the plugin's: the queues' puts wake it
            assert getattr(reader.prefetch_queue.put, "__name__", "") == "put_and_wake"
        assert (stores[1].stats().hits, stores[1].stats().misses) == (2, 1)
    finally:
        for store in stores:
            store.close()


def test_a_put_wakes_an_idle_loop_at_once(waiting: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(io_loop, "IDLE_WAIT", 3600.0)  # only a put can end an idle round
    store = MemoryStore()
    with unpinned_controller(store, DIMS, DTYPE) as controller:
        reads = count_queue_reads(controller)
        fill(controller, "21", embedding(10, 3), IMAGE)
        publish(controller, ["21"], IMAGE)  # fails after 30 s if the put did not wake it
        assert list(store.entries) == ["21"]
        controller.stop_event.set()
        controller.insert_batch(["21"], IMAGE)  # a put ends the last wait too
        controller.io_thread.join(timeout=30)
        assert not controller.io_thread.is_alive()
    assert reads[0] <= 3  # the first round (if not already read), the insert's; the stop reads none


def test_a_set_stop_event_ends_an_idle_loop(waiting: None) -> None:
    with unpinned_controller(MemoryStore(), DIMS, DTYPE) as controller:
        controller.stop_event.set()
        controller.io_thread.join(timeout=30)  # a hang guard: the idle wait is bounded
        assert not controller.io_thread.is_alive()


def test_a_store_call_that_raises_fails_its_items_and_the_loop_goes_on(
    waiting: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SGLANGS_LOGGER)
    store = MemoryStore()
    with unpinned_controller(store, DIMS, DTYPE) as controller:
        fill(controller, "31", embedding(10, 4), IMAGE)
        store.failing = True
        publish(controller, ["31"], IMAGE)  # the entry is unpinned, kept in the pool
        assert store.entries == {} and controller.has_local_embedding("31")
        assert fetch(controller, ["32"], [10], IMAGE) == [None]
        assert not controller.has_local_embedding("32")  # its pages given back
        failed = {r.getMessage(): r for r in caplog.records if r.name == SGLANGS_LOGGER}
        for what in ("PUT", "GET"):
            record = failed[f"Mooncake multi-buffer {what} failed"]
            assert record.levelno == logging.ERROR and record.exc_info is not None  # with the traceback
        assert "Mooncake PUT Finished: Stored 0/1 embeddings in cluster." in failed
        assert "Mooncake GET Finished: Req req, Successfully fetched 0/1 embeddings." in failed
        store.failing = False
        publish(controller, ["31"], IMAGE)
        assert list(store.entries) == ["31"]
        assert controller.io_thread.is_alive()


def test_a_controller_without_the_parts_it_needs_runs_sglangs_loop() -> None:
    ran: list[object] = []

    def original(controller: object) -> None:
        ran.append(controller)

    bare = SimpleNamespace(prefetch_queue=queue.Queue(), insert_queue=queue.Queue())
    io_loop.waiting_io_loop(original, cast(EmbeddingCacheController, bare))  # another version's
    assert ran == [bare]


def test_queues_whose_put_cannot_signal_run_sglangs_loop() -> None:
    ran: list[object] = []

    def original(controller: object) -> None:
        ran.append(controller)

    controller = SimpleNamespace(
        prefetch_queue=queue.SimpleQueue(),
        insert_queue=queue.SimpleQueue(),
        stop_event=threading.Event(),
        embedding_store=MemoryStore(),
        _finish_get=print,
        _finish_put=print,
    )
    io_loop.waiting_io_loop(original, cast(EmbeddingCacheController, controller))  # queues without a dict
    assert ran == [controller]


def test_an_idle_loop_does_not_read_its_queues_while_sglangs_beside_it_polls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two idle controllers at once, SGLang's loop and the plugin's: while SGLang's reads its
    queue a hundred times, the plugin's (its idle wait made an hour) reads it once."""
    monkeypatch.setattr(io_loop, "IDLE_WAIT", 3600.0)
    with unpinned_controller(MemoryStore(), DIMS, DTYPE) as polling:  # its thread runs SGLang's loop
        polled = count_queue_reads(polling)
        monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
        monkeypatch.setattr(HookRegistry, "_patched", set())
        monkeypatch.setattr(io_loop, "_installed", False)
        monkeypatch.setattr(EmbeddingCacheController, "_io_loop", SGLANGS["loop"])
        io_loop.install()
        HookRegistry.apply_hooks()
        with unpinned_controller(MemoryStore(), DIMS, DTYPE) as waiting:
            reads = count_queue_reads(waiting)
            start = polled[0]
            assert wait_until(lambda: polled[0] >= start + 100, 30)
            assert reads[0] <= 1  # at most the round it was in when counting began
            waiting.stop_event.set()
            waiting.insert_queue.put(None)  # type: ignore[arg-type]  # any put ends its wait; never read
        polling.stop_event.set()


def test_queued_operations_are_served_back_to_back_without_an_idle_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round that served an operation goes straight to the next: operations queued before
    the loop started (so no put woke it) are all served, though an idle wait lasts an hour."""
    monkeypatch.setattr(io_loop, "IDLE_WAIT", 3600.0)
    store = MemoryStore()
    finished: list[tuple[str, list[bool]]] = []
    controller = SimpleNamespace(
        prefetch_queue=queue.Queue(),
        insert_queue=queue.Queue(),
        stop_event=threading.Event(),
        embedding_store=store,
        _finish_get=lambda op, results: finished.append(("get", results)),
        _finish_put=lambda op, results: finished.append(("put", results)),
    )
    data = (ctypes.c_char * 8)()

    def insert(h: str) -> None:
        op = SimpleNamespace(keys=[h], ptrs=[[ctypes.addressof(data)]], sizes=[[8]], req_id="req")
        controller.insert_queue.put(op)

    for h in ("41", "42", "43"):
        insert(h)
    loop = threading.Thread(
        target=io_loop.waiting_io_loop,
        args=(SGLANGS["loop"], cast(EmbeddingCacheController, controller)),
        daemon=True,
    )
    loop.start()
    try:
        assert wait_until(lambda: len(finished) == 3, 30)
        assert finished == [("put", [True])] * 3 and list(store.entries) == ["41", "42", "43"]
    finally:
        controller.stop_event.set()
        insert("44")  # a put ends an idle wait (served, harmlessly, if read before the stop)
        loop.join(timeout=30)
    assert not loop.is_alive()


def test_the_hook_is_registered_only_by_install_and_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module as a new process imports it: not installed until `install`, one hook however
    many times it runs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mmkey_fresh_sglang_io_loop", io_loop.__file__)
    assert spec is not None and spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    assert not fresh.installed() and not HookRegistry._hooks[io_loop.IO_LOOP]
    fresh.install()
    fresh.install()
    assert fresh.installed()
    assert len(HookRegistry._hooks[io_loop.IO_LOOP]) == 1, "one hook however many installs"
