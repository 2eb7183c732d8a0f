"""`MooncakeCache`: the `EmbeddingCache` protocol over a Mooncake distributed store.

It closes the binding's traps: it probes the master before `setup` (which otherwise
blocks ~90 s), never calls a store that is not set up or is closed (the binding crashes
the interpreter there), de-duplicates batch reads (duplicates read wrong data), writes
with upsert (a put never overwrites), tells misses from entries (both read as ``b""``),
and verifies every entry through the codec. Every call runs on one worker thread and the
caller waits at most ``config.deadline``; after a failure a breaker leaves the store alone
for ``config.retry_after`` seconds, then tries again, so a restarted master is re-joined
by itself. Entries move through registered buffers (`batch_upsert_from`,
`batch_get_into`), not Python bytes copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from mmkey._net import parse_host_port, port_accepts
from mmkey.cache._guard import insert_args, key_texts
from mmkey.cache.codec import decode_entry, encode_entry_into, entry_size
from mmkey.cache.mooncake_config import MooncakeConfig
from mmkey.cache.protocol import CacheStats
from mmkey.cache._runner import Breaker, CallTimeout, DeadlineRunner
from mmkey.errors import CorruptEntry, StoreClosed, StoreError
from mmkey.keys import CacheKey

if TYPE_CHECKING:
    import torch
    from mooncake.store import MooncakeDistributedStore

__all__ = ["MooncakeCache", "MooncakeConfig"]

T = TypeVar("T")

_RPC_FAILURES = frozenset({-900, -901})
"""Codes that mean the master did not answer (RPC_FAIL, RPC_TIMEOUT)."""
_BUFFER_TOO_SMALL = -600
_ALIGN = 64
_MIN_SLOT = 256 << 10
_MAX_READ_BUFFER = 512 << 20
"""Largest read buffer one batch read allocates; longer batches are split."""
_COPY_BELOW = 1 << 20
"""Entries smaller than this are copied out of the read buffer so it can be freed."""
_INSTALL_HINT = (
    "install the binding: pip install 'mmkey[mooncake-cpu]' on CPU machines (plus Debian's "
    "libibverbs1 libnuma1 libcurl4) or 'mmkey[mooncake]' on GPU machines"
)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Counters:
    """Thread-safe counters behind `stats()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = self.misses = self.inserts = self.corrupt = self.errors = 0

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                hits=self.hits,
                misses=self.misses,
                inserts=self.inserts,
                corrupt=self.corrupt,
                errors=self.errors,
            )


class MooncakeCache:
    """A strict, fault-tolerant `EmbeddingCache` over ``mooncake.store``.

    Store failures never raise into the caller: reads become misses, inserts report
    ``False``, and both are counted in ``stats().errors``. Only misuse raises: wrong key
    types (`TypeError`), mismatched lengths (`ValueError`), calls after `close`
    (`StoreClosed`), and a binding that cannot be imported (`StoreError`, at construction).
    """

    def __init__(self, config: MooncakeConfig) -> None:
        value: object = config
        if not isinstance(value, MooncakeConfig):
            raise TypeError(
                f"MooncakeCache takes a MooncakeConfig, got {type(value).__name__}; "
                "use MooncakeConfig(master_server_address='host:port') or MooncakeConfig.from_env()"
            )
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StoreError(f"the Mooncake binding cannot be imported ({exc}); {_INSTALL_HINT}") from None
        self._config = config
        self._store_class = MooncakeDistributedStore
        self._host, self._port = parse_host_port(config.master_server_address)
        self._runner = DeadlineRunner("mmkey-mooncake")
        self._breaker = Breaker(config.retry_after)
        self._counts = _Counters()
        self._store: MooncakeDistributedStore | None = None  # set and cleared on the worker only
        self._closed = False
        self._slot = _MIN_SLOT
        self._suspect = False  # a call failed: probe the master's port before the next one
        self._connect()

    @property
    def config(self) -> MooncakeConfig:
        """The configuration this cache was made with."""
        return self._config

    def is_connected(self) -> bool:
        """Whether the store is set up and the last call to it succeeded."""
        return self._store is not None and not self._breaker.is_open()

    # -- the EmbeddingCache protocol ------------------------------------------------------

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held by the store; `False` when the store is unreachable."""
        texts = self._texts(keys, "batch_is_exist")
        if not texts:
            return []
        codes = self._call(lambda store: store.batch_is_exist(texts))
        if codes is None:
            return [False] * len(texts)
        if any(code in _RPC_FAILURES for code in codes):
            self._fail()
        return [code == 1 for code in codes]

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The verified embedding of each key, or None (a miss, a corrupt entry, a fault)."""
        texts = self._texts(keys, "get_embeddings")
        unique = list(dict.fromkeys(texts))
        found: dict[str, torch.Tensor] = {}
        per_read = max(1, _MAX_READ_BUFFER // self._slot)
        for start in range(0, len(unique), per_read):
            found.update(self._read(unique[start : start + per_read]))
        result = [found.get(text) for text in texts]
        hits = sum(t is not None for t in result)
        self._counts.add(hits=hits, misses=len(result) - hits)
        return result

    def insert_batch(
        self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]
    ) -> list[bool]:
        """Store each embedding under its key, replacing what was there; whether each is stored.

        A key given twice in one batch stores its last embedding.
        """
        self._check_open()
        texts, tensors = insert_args(keys, embeddings)
        latest = dict(zip(texts, tensors))
        stored = self._write(list(latest), list(latest.values())) if latest else {}
        self._counts.add(inserts=sum(stored.values()))
        return [stored.get(text, False) for text in texts]

    def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """How many of the keys the store holds (a remote store has no nearer tier)."""
        return sum(self.batch_is_exist(keys))

    def stats(self) -> CacheStats:
        """Hits, misses, inserts, corrupt entries and store errors since creation."""
        return self._counts.snapshot()

    def close(self) -> None:
        """Close the store (waiting at most ``setup_deadline``); later calls raise `StoreClosed`."""
        if self._closed:
            return
        self._closed = True
        future = self._runner.submit(self._close_on_worker)
        self._runner.stop()
        try:
            future.result(timeout=self._config.setup_deadline)
        except Exception:  # a hung store: the worker closes it when its call returns
            self._counts.add(errors=1)

    def __enter__(self) -> MooncakeCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self.is_connected() else "degraded")
        return f"MooncakeCache({self._config.master_server_address!r}, {state})"

    # -- reads and writes -------------------------------------------------------------------

    def _read(self, texts: list[str]) -> dict[str, torch.Tensor]:
        import torch

        slot = self._slot
        buf = torch.empty(slot * len(texts), dtype=torch.uint8)
        ptr = buf.data_ptr()
        ptrs = [ptr + i * slot for i in range(len(texts))]

        def read(store: MooncakeDistributedStore) -> list[int]:
            if store.register_buffer(ptr, buf.numel()) != 0:
                raise StoreError("register_buffer failed")
            try:
                return store.batch_get_into(texts, ptrs, [slot] * len(texts))
            finally:
                store.unregister_buffer(ptr)

        codes = self._call(read)
        if codes is None:
            return {}
        found: dict[str, torch.Tensor] = {}
        too_big: list[str] = []
        for i, (text, code) in enumerate(zip(texts, codes)):
            if code > 0:
                view = buf[i * slot : i * slot + code]
                self._decode_into(found, text, view, copy=code < _COPY_BELOW)
            elif code == _BUFFER_TOO_SMALL:
                too_big.append(text)
            elif code in _RPC_FAILURES:
                self._fail()
        for text in too_big:
            self._read_large(text, found)
        return found

    def _read_large(self, text: str, found: dict[str, torch.Tensor]) -> None:
        import torch

        def read(store: MooncakeDistributedStore) -> torch.Tensor | None:
            size = store.get_size(text)
            if size <= 0:
                return None
            buf = torch.empty(size, dtype=torch.uint8)
            if store.register_buffer(buf.data_ptr(), size) != 0:
                raise StoreError("register_buffer failed")
            try:
                got = store.get_into(text, buf.data_ptr(), size)
            finally:
                store.unregister_buffer(buf.data_ptr())
            return buf if got == size else None

        buf = self._call(read)
        if buf is not None:
            self._slot = max(self._slot, min(_aligned(buf.numel()), self._config.local_buffer_size))
            self._decode_into(found, text, buf, copy=False)

    def _decode_into(
        self, found: dict[str, torch.Tensor], text: str, raw: torch.Tensor, *, copy: bool
    ) -> None:
        try:
            found[text] = decode_entry(text, raw.numpy().data, copy=copy)
        except CorruptEntry:
            self._counts.add(corrupt=1)

    def _write(self, texts: list[str], tensors: list[torch.Tensor]) -> dict[str, bool]:
        import torch

        sizes = [entry_size(text, t) for text, t in zip(texts, tensors)]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + _aligned(size))
        buf = torch.empty(offsets[-1], dtype=torch.uint8)
        whole = buf.numpy().data
        for text, t, start, size in zip(texts, tensors, offsets, sizes):
            encode_entry_into(whole[start : start + size], text, t)
        ptr = buf.data_ptr()
        ptrs = [ptr + start for start in offsets[:-1]]

        def write(store: MooncakeDistributedStore) -> list[int]:
            if store.register_buffer(ptr, buf.numel()) != 0:
                raise StoreError("register_buffer failed")
            try:
                return store.batch_upsert_from(texts, ptrs, sizes)
            finally:
                store.unregister_buffer(ptr)

        codes = self._call(write)
        if codes is None:
            return {}
        if any(code in _RPC_FAILURES for code in codes):
            self._fail()
        return {text: code == 0 for text, code in zip(texts, codes)}

    # -- calls, deadlines, the breaker ----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this MooncakeCache is closed; create a new one")

    def _texts(self, keys: Sequence[CacheKey], method: str) -> list[str]:
        self._check_open()
        return key_texts(keys, method)

    def _call(self, fn: Callable[[MooncakeDistributedStore], T]) -> T | None:
        """`fn(store)` on the worker within the deadline, or None after counting a failure."""
        if self._runner.is_busy() or not self._breaker.allow():
            self._counts.add(errors=1)
            return None
        if self._store is None or self._suspect:
            if not port_accepts(self._host, self._port, min(self._config.deadline, 0.2)):
                self._fail()
                return None
            if self._store is None and not self._connect():
                return None

        def on_worker() -> T:
            store = self._store
            if store is None or self._closed:
                raise StoreClosed("store closed")
            return fn(store)

        try:
            result = self._runner.call(on_worker, self._config.deadline)
        except CallTimeout:
            self._fail()
            return None
        except StoreError:
            self._fail()
            return None
        self._breaker.success()
        self._suspect = False
        return result

    def _fail(self) -> None:
        self._breaker.failure()
        self._suspect = True
        self._counts.add(errors=1)

    def _connect(self) -> bool:
        """Set the store up if the master answers; False (counted) if it does not."""
        if not port_accepts(self._host, self._port, min(self._config.setup_deadline, 0.5)):
            self._fail()
            return False
        try:
            ok = self._runner.call(self._setup_on_worker, self._config.setup_deadline)
        except CallTimeout:
            ok = False
        if not ok:
            self._fail()
        return ok

    def _setup_on_worker(self) -> bool:
        if self._closed:
            return False
        if self._store is not None:
            return True
        store = self._store_class()
        if store.setup(*self._config.setup_args()) != 0:
            store.close()
            return False
        self._store = store
        return True

    def _close_on_worker(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()
