"""SGLang's encode server with counters for the serving benchmark: what its tower and store did.

``python benchmarks/sglang_serve_worker.py <SGLang's server options>`` runs
``sglang.launch_server`` as SGLang's own launcher does, after three additions: each encoder's
model has its image feature function (the vision tower) timed and counted; every embedding
store backend SGLang creates has its reads and writes counted (entries and bytes of the calls
that landed, and mmkey's single-flight counters); and the encoder's HTTP app answers
``GET /mmkey_counts`` with the totals as JSON.
The encoder runs in the server's own process at tensor parallel size 1, so the counters see
every call.
"""

from __future__ import annotations

import functools
import importlib
import runpy
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["COUNTERS", "WAITS", "counts", "install"]

COUNTERS = ("tower_images", "tower_s", "loaded_items", "loaded_bytes", "saved_items", "saved_bytes")
_counts: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
_lock = threading.Lock()


def _add(**deltas: float) -> None:
    with _lock:
        for name, value in deltas.items():
            _counts[name] += value


_stores: list[Any] = []
WAITS = ("waits_served", "waits_timed_out", "coalesced")
"""Single-flight counters of a store backend that keeps them (mmkey's `stats()`)."""


def counts() -> dict[str, float]:
    """The totals since the server started, with the stores' single-flight counters."""
    with _lock:
        found = dict(_counts)
    for store in _stores:
        stats = getattr(store, "stats", None)
        if callable(stats):
            totals = stats()
            for name in WAITS:
                found[name] = found.get(name, 0.0) + float(getattr(totals, name, 0) or 0)
    return found


def _images(items: Any) -> int:
    """How many images a tower call encodes: an item of a batch SGLang fused holds several,
    one row of its ``image_grid_thw`` each."""
    total = 0
    for item in items:
        grid: Any
        try:
            grid = getattr(item, "image_grid_thw", None)
        except (AttributeError, KeyError):
            grid = None
        total += int(grid.shape[0]) if hasattr(grid, "shape") and len(grid.shape) == 2 else 1
    return total


def _timed_tower(feature: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(feature)
    def timed(items: Any) -> Any:
        start = time.perf_counter()
        try:
            return feature(items)
        finally:
            _add(tower_images=_images(items), tower_s=time.perf_counter() - start)

    return timed


def _counted_store(store: Any) -> Any:
    """``store`` with its multi-buffer reads and writes counted (entries that landed, their bytes)."""
    for method, items, size in (
        ("batch_get_into_multi_buffers", "loaded_items", "loaded_bytes"),
        ("batch_put_from_multi_buffers", "saved_items", "saved_bytes"),
    ):
        inner = getattr(store, method)

        def counted(
            hashes: list[str],
            ptrs: list[list[int]],
            sizes: list[list[int]],
            _inner: Any = inner,
            _items: str = items,
            _size: str = size,
        ) -> list[bool]:
            done: list[bool] = _inner(hashes, ptrs, sizes)
            landed = [
                s for s, ok in zip(sizes, done, strict=False) if ok
            ]  # a short answer: count what is there
            _add(**{_items: len(landed), _size: sum(sum(s) for s in landed)})
            return done

        setattr(store, method, counted)
    _stores.append(store)
    return store


def install() -> None:
    """Hook the encoder, the store factory and the HTTP app (call before the server starts)."""
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

    server: Any = importlib.import_module("sglang.srt.disaggregation.encoder.server")
    http_server: Any = importlib.import_module("sglang.srt.disaggregation.encoder.http_server")

    init = server.MMEncoder.__init__

    def counted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        target = self.model.thinker if hasattr(self.model, "thinker") else self.model
        target.get_image_feature = _timed_tower(target.get_image_feature)

    server.MMEncoder.__init__ = counted_init
    create = EmbeddingStoreFactory.create_backend

    def counted_create(name: str, **kwargs: Any) -> Any:
        return _counted_store(create(name, **kwargs))

    EmbeddingStoreFactory.create_backend = staticmethod(counted_create)  # type: ignore[method-assign,assignment]

    async def mmkey_counts() -> dict[str, float]:
        return counts()

    http_server.app.add_api_route("/mmkey_counts", mmkey_counts, methods=["GET"])


def main() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # first, as SGLang's launcher does (a second call there does nothing)
    install()
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
