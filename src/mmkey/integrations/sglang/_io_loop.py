"""SGLang's embedding-cache I/O thread, woken by its queues instead of polling them.

SGLang's ``EmbeddingCacheController._io_loop`` takes one prefetch and one insert from its two
queues per round and, when both are empty, sleeps 1 ms and looks again: on a server with
nothing to fetch or store the thread wakes a thousand times a second, in the process that
runs the vision tower. Measured on this project's CPU benchmark host, a tower beside such a
thread ran 5% slower (402 against 383 ms an image). Once opted in, the plugin registers
`waiting_io_loop` as an ``AROUND`` hook of that loop: the same work in the same order, with
SGLang's log lines, but an idle thread waits on an event that each ``put`` onto either queue
sets, for at most `IDLE_WAIT` seconds a round so that it still sees ``stop_event``. Where the
controller lacks a part this loop needs (another SGLang version), SGLang's own loop runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from queue import Empty, Queue
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from sglang.srt.mem_cache.embedding_cache_controller import (
        EmbeddingCacheController,
        EmbeddingInsertOperation,
        EmbeddingPrefetchOperation,
    )

__all__ = ["IDLE_WAIT", "IO_LOOP", "install", "installed", "waiting_io_loop"]

IO_LOOP = "sglang.srt.mem_cache.embedding_cache_controller.EmbeddingCacheController._io_loop"
"""The loop of the controller's I/O thread (started by the controller's ``__init__``)."""
IDLE_WAIT = 0.05
"""The longest an idle round waits for a ``put`` (seconds): how soon a set ``stop_event`` ends it."""

_NEEDED = ("prefetch_queue", "insert_queue", "embedding_store", "stop_event", "_finish_get", "_finish_put")
"""The controller's parts this loop uses (SGLang 0.5.23's names)."""

logger: logging.Logger = logging.getLogger(__name__)

_installed = False

_Op = TypeVar("_Op", "EmbeddingPrefetchOperation", "EmbeddingInsertOperation")


def _wake_on_put(queue: Queue[Any], wake: threading.Event) -> None:
    """Make `queue`'s ``put`` set `wake` once the item is in."""
    put = queue.put

    def put_and_wake(item: Any, block: bool = True, timeout: float | None = None) -> None:
        put(item, block, timeout)
        wake.set()

    queue.put = put_and_wake  # type: ignore[method-assign]


def _serve_one(
    queue: Queue[_Op],
    transfer: Callable[[list[str], list[list[int]], list[list[int]]], list[bool]],
    finish: Callable[[_Op, list[bool]], None],
    report: Callable[[_Op, list[bool] | None], None],
) -> bool:
    """Run one queued operation through the store, if one waits; whether one did. A store
    call that raises fails every item of the operation, as in SGLang's loop."""
    try:
        op = queue.get_nowait()
    except Empty:
        return False
    try:
        results = transfer(op.keys, op.ptrs, op.sizes)
    except Exception:
        report(op, None)
        results = [False] * len(op.keys)
    else:
        report(op, results)
    finish(op, results)
    queue.task_done()
    return True


def _reporters(
    sglang_logger: logging.Logger,
) -> tuple[
    Callable[[EmbeddingPrefetchOperation, list[bool] | None], None],
    Callable[[EmbeddingInsertOperation, list[bool] | None], None],
]:
    """What SGLang's loop logs after a get and a put (operators' log readers and this
    project's engine tests read these lines), through SGLang's own logger; a result of None
    is a store call that raised (logged from inside its ``except``)."""

    def got(op: EmbeddingPrefetchOperation, results: list[bool] | None) -> None:
        if results is None:
            sglang_logger.exception("Mooncake multi-buffer GET failed")
            results = [False] * len(op.keys)
        sglang_logger.info(
            "Mooncake GET Finished: Req %s, Successfully fetched %d/%d embeddings.",
            op.req_id,
            sum(results),
            len(op.keys),
        )

    def put(op: EmbeddingInsertOperation, results: list[bool] | None) -> None:
        if results is None:
            sglang_logger.exception("Mooncake multi-buffer PUT failed")
            results = [False] * len(op.keys)
        sglang_logger.info(
            "Mooncake PUT Finished: Stored %d/%d embeddings in cluster.", sum(results), len(op.keys)
        )

    return got, put


def waiting_io_loop(original: Callable[[Any], None], controller: EmbeddingCacheController) -> None:
    """SGLang ``AROUND`` hook of `IO_LOOP`: serve the controller's queues until its
    ``stop_event`` is set, waiting for a ``put`` (at most `IDLE_WAIT` seconds) when both are
    empty; SGLang's `original` loop where the controller lacks a part of `_NEEDED`."""
    missing = [name for name in _NEEDED if not hasattr(controller, name)]
    if missing:
        logger.warning(
            "mmkey: SGLang's embedding cache lacks %s; its own polling I/O loop runs", ", ".join(missing)
        )
        original(controller)
        return
    wake = threading.Event()
    try:
        for queue in (controller.prefetch_queue, controller.insert_queue):
            _wake_on_put(queue, wake)
    except AttributeError:  # a queue type without an instance dict: its put cannot be wrapped
        logger.warning("mmkey: SGLang's embedding cache queues cannot signal; its own polling I/O loop runs")
        original(controller)
        return
    got, put = _reporters(logging.getLogger(getattr(original, "__module__", None) or __name__))  # SGLang's
    logger.info("mmkey: the embedding cache's I/O thread waits for work instead of polling every 1 ms")
    while not controller.stop_event.is_set():
        store = controller.embedding_store
        fetched = _serve_one(
            controller.prefetch_queue, store.batch_get_into_multi_buffers, controller._finish_get, got
        )
        stored = _serve_one(
            controller.insert_queue, store.batch_put_from_multi_buffers, controller._finish_put, put
        )
        if not (fetched or stored):
            # a put after the queues were read sets `wake`, so this returns at once; one made
            # between this wait's end and the clear is already queued, and read next round
            wake.wait(IDLE_WAIT)
            wake.clear()


def installed() -> bool:
    """Whether `install` registered the hook in this process."""
    return _installed


def install() -> None:
    """Register `waiting_io_loop` with SGLang's hook registry (applied by ``load_plugins``)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(IO_LOOP, waiting_io_loop, HookType.AROUND)
    _installed = True
