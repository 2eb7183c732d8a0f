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

import contextlib
import functools
import threading
import warnings
import time
from collections.abc import Callable, Iterator, Sequence
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
_MAX_STAGING = 256 << 20
"""Largest registered staging buffer; larger entries get a buffer of their own."""
_INSTALL_HINT = (
    "install the binding: pip install 'mmkey[mooncake-cpu]' on CPU machines (plus Debian's "
    "libibverbs1 libnuma1 libcurl4) or 'mmkey[mooncake]' on GPU machines"
)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@contextlib.contextmanager
def _registered(store: MooncakeDistributedStore, buf: torch.Tensor) -> Iterator[int]:
    """Register `buf` with the store for a zero-copy transfer; yields its address."""
    ptr = buf.data_ptr()
    if store.register_buffer(ptr, buf.numel()) != 0:
        raise StoreError("register_buffer failed")
    try:
        yield ptr
    finally:
        store.unregister_buffer(ptr)


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
        self._slot = _MIN_SLOT  # bytes a read reserves per key; grows to the largest entry seen
        self._staging_bytes = min(config.local_buffer_size, _MAX_STAGING)
        self._staging: memoryview | None = None  # registered, touched only on the worker
        self._staging_ptr = 0
        self._staging_lease = threading.Lock()
        """Held while the staging buffer is filled or read: by the worker while it writes,
        and from a read's transfer until its caller has decoded the entries."""
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
        if not _RPC_FAILURES.isdisjoint(codes):
            self._fail()
        return [code == 1 for code in codes]

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The verified embedding of each key, or None (a miss, a corrupt entry, a fault)."""
        texts = self._texts(keys, "get_embeddings")
        unique = list(dict.fromkeys(texts))
        found = self._read(unique) if unique else {}
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
        self._check_open()
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

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(
                f"{self!r} was never closed: its store, worker thread and registered buffer "
                "live until the process exits; call close() or use it as a context manager",
                ResourceWarning,
                stacklevel=2,
            )

    def __enter__(self) -> MooncakeCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self.is_connected() else "degraded")
        return f"MooncakeCache({self._config.master_server_address!r}, {state})"

    # -- reads and writes: whole operations on the worker, through the staging buffer -----

    def _read(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Verified tensors of the keys found.

        The worker only moves entries into the registered staging buffer; the caller's
        thread decodes them from there (allocating where the caller's tensors live), holding
        the staging lease so that no other transfer overwrites the buffer meanwhile.
        """
        found: dict[str, torch.Tensor] = {}
        too_big: list[str] = []
        start = 0
        while start < len(texts):
            chunk = texts[start : start + max(1, self._staging_bytes // self._slot)]
            start += len(chunk)
            slot = self._staging_bytes // len(chunk) // _ALIGN * _ALIGN
            moved = self._call(
                functools.partial(self._transfer_on_worker, chunk=chunk, slot=slot),
                abandoned=lambda _: self._staging_lease.release(),
            )
            if moved is None:
                return found
            staging, codes = moved
            try:
                for i, (text, code) in enumerate(zip(chunk, codes)):
                    if code > 0:
                        self._decode_into(found, text, staging[i * slot : i * slot + code])
                    elif code == _BUFFER_TOO_SMALL:
                        too_big.append(text)
            finally:
                self._staging_lease.release()
        if too_big:
            found.update(self._call(lambda store: self._read_large_on_worker(store, too_big)) or {})
        return found

    def _transfer_on_worker(
        self, store: MooncakeDistributedStore, chunk: list[str], slot: int
    ) -> tuple[memoryview, list[int]]:
        """Entries of `chunk` into staging slots of `slot` bytes; returns with the lease held."""
        staging = self._staging_on_worker(store)
        self._staging_lease.acquire()
        try:
            base = self._staging_ptr
            ptrs = [base + i * slot for i in range(len(chunk))]
            codes = store.batch_get_into(chunk, ptrs, [slot] * len(chunk))
            if not _RPC_FAILURES.isdisjoint(codes):
                raise StoreError(f"batch_get_into: master unreachable ({codes})")
        except BaseException:
            self._staging_lease.release()
            raise
        return staging, codes

    def _read_large_on_worker(
        self, store: MooncakeDistributedStore, texts: list[str]
    ) -> dict[str, torch.Tensor]:
        """Entries larger than a staging slot, each read into a buffer of its exact size."""
        import torch

        found: dict[str, torch.Tensor] = {}
        for text in texts:
            size = store.get_size(text)
            if size in _RPC_FAILURES:
                raise StoreError(f"get_size: master unreachable ({size})")
            if size <= 0:
                continue
            self._slot = max(self._slot, min(_aligned(size), self._staging_bytes))
            buf = torch.empty(size, dtype=torch.uint8)
            with _registered(store, buf) as ptr:
                got = store.get_into(text, ptr, size)
            if got in _RPC_FAILURES:
                raise StoreError(f"get_into: master unreachable ({got})")
            if got == size:
                self._decode_into(found, text, buf.numpy().data, copy=False)
        return found

    def _decode_into(
        self, found: dict[str, torch.Tensor], text: str, raw: memoryview, *, copy: bool = True
    ) -> None:
        try:
            found[text] = decode_entry(text, raw, copy=copy)
        except CorruptEntry:
            self._counts.add(corrupt=1)

    def _write(self, texts: list[str], tensors: list[torch.Tensor]) -> dict[str, bool]:
        """Upsert entries through the staging buffer; runs on the worker thread."""
        sizes = [entry_size(text, t) for text, t in zip(texts, tensors)]
        # The worker reads the caller's tensors only while holding `reading`, and never
        # after the caller stopped waiting (`released`): a caller that timed out may reuse
        # its tensors at once, and a late encode would store that new data under old keys.
        reading = threading.Lock()
        released = threading.Event()

        def encode(target: memoryview, text: str, tensor: torch.Tensor) -> None:
            with reading:
                if released.is_set():
                    raise StoreError("insert_batch stopped waiting; its tensors are not read")
                encode_entry_into(target, text, tensor)

        def write(store: MooncakeDistributedStore) -> dict[str, bool]:
            staging = self._staging_on_worker(store)
            with self._staging_lease:
                return fill_and_flush(store, staging)

        def fill_and_flush(store: MooncakeDistributedStore, staging: memoryview) -> dict[str, bool]:
            stored: dict[str, bool] = {}
            batch: list[tuple[str, int, int]] = []  # key text, offset, size
            used = 0
            for text, t, size in zip(texts, tensors, sizes):
                if size > staging.nbytes:
                    stored[text] = self._write_large_on_worker(store, text, t, size, encode)
                    continue
                if used + size > staging.nbytes:
                    stored.update(self._flush_on_worker(store, batch))
                    batch, used = [], 0
                encode(staging[used : used + size], text, t)
                batch.append((text, used, size))
                used += _aligned(size)
            stored.update(self._flush_on_worker(store, batch))
            return stored

        try:
            return self._call(write) or {}
        finally:
            with reading:  # waits out an entry being encoded right now, if any
                released.set()

    def _flush_on_worker(
        self, store: MooncakeDistributedStore, batch: list[tuple[str, int, int]]
    ) -> dict[str, bool]:
        if not batch:
            return {}
        keys = [text for text, _, _ in batch]
        ptrs = [self._staging_ptr + offset for _, offset, _ in batch]
        codes = store.batch_upsert_from(keys, ptrs, [size for _, _, size in batch])
        if not _RPC_FAILURES.isdisjoint(codes):
            raise StoreError(f"batch_upsert_from: master unreachable ({codes[0]})")
        return {text: code == 0 for text, code in zip(keys, codes)}

    def _write_large_on_worker(
        self,
        store: MooncakeDistributedStore,
        text: str,
        tensor: torch.Tensor,
        size: int,
        encode: Callable[[memoryview, str, torch.Tensor], None],
    ) -> bool:
        import torch

        buf = torch.empty(size, dtype=torch.uint8)
        encode(buf.numpy().data, text, tensor)
        with _registered(store, buf) as ptr:
            code = store.upsert_from(text, ptr, size)
        if code in _RPC_FAILURES:
            raise StoreError(f"upsert_from: master unreachable ({code})")
        return code == 0

    def _staging_on_worker(self, store: MooncakeDistributedStore) -> memoryview:
        """The registered staging buffer, allocated and registered on first use."""
        if self._staging is None:
            import torch

            buf = torch.empty(self._staging_bytes, dtype=torch.uint8)
            if store.register_buffer(buf.data_ptr(), buf.numel()) != 0:
                raise StoreError("register_buffer of the staging buffer failed")
            self._staging_ptr = buf.data_ptr()
            self._staging = buf.numpy().data  # keeps `buf` alive
        return self._staging

    # -- calls, deadlines, the breaker ----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this MooncakeCache is closed; create a new one")

    def _texts(self, keys: Sequence[CacheKey], method: str) -> list[str]:
        self._check_open()
        return key_texts(keys, method)

    def _call(
        self,
        fn: Callable[[MooncakeDistributedStore], T],
        abandoned: Callable[[T], object] | None = None,
    ) -> T | None:
        """`fn(store)` on the worker within the deadline, or None after counting a failure."""
        if self._runner.is_stuck(self._config.deadline) or not self._breaker.allow():
            self._counts.add(errors=1)
            return None
        if self._store is None:
            # re-join within this call's deadline; a slower setup finishes on the worker
            if not self._connect(self._config.deadline):
                return None
        elif self._suspect:
            if not port_accepts(self._host, self._port, min(self._config.deadline, 0.2)):
                self._fail()
                return None

        def on_worker() -> T:
            store = self._store
            if store is None or self._closed:
                raise StoreClosed("store closed")
            return fn(store)

        try:
            result = self._runner.call(on_worker, self._config.deadline, abandoned)
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

    def _connect(self, wait: float | None = None) -> bool:
        """Set the store up if the master answers; False (counted) if it does not.

        The caller waits at most `wait` seconds (``setup_deadline`` by default); a setup
        still running then finishes on the worker, and a later call finds the store set up.
        """
        wait = self._config.setup_deadline if wait is None else wait
        give_up = time.monotonic() + wait
        if not port_accepts(self._host, self._port, min(wait, 0.5)):
            self._fail()
            return False
        try:
            ok = self._runner.call(self._setup_on_worker, max(give_up - time.monotonic(), 0.001))
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
            store.close()  # measured safe on a store whose setup failed (contract test)
            return False
        self._store = store
        return True

    def _close_on_worker(self) -> None:
        with self._staging_lease:  # a caller may still be decoding from the staging buffer
            store, self._store = self._store, None
            if store is not None:
                if self._staging is not None:
                    store.unregister_buffer(self._staging_ptr)
                store.close()
            self._staging = None
