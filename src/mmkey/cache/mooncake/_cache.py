"""`MooncakeCache`: the `EmbeddingCache` protocol over a Mooncake distributed store.

The facade: key checks, the entry codec, de-duplication and counters. It closes the
binding's traps: it never calls a store that is not set up or is closed (the binding
crashes the interpreter there), de-duplicates batch reads (duplicates read wrong data),
writes with upsert (a put never overwrites), tells misses from entries (both read as
``b""``), and verifies every entry through the codec. The transport
(`mmkey.cache.mooncake._transport`) runs every binding call on a worker within the call's
deadline, behind a breaker, and calls the binding's GIL-holding ``setup``/``close`` only
right after the master answered; staging (`mmkey.cache.mooncake._staging`) moves entries
through registered buffers (``batch_upsert_from``, ``batch_get_into``), not Python bytes copies.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from mmkey._log import Counters, RateLimitedLog
from mmkey._tensors import byte_view, host_ready
from mmkey.cache._guard import insert_args, key_texts
from mmkey.cache.mooncake._replicas import memory_endpoints
from mmkey.cache.mooncake._staging import Staging, aligned, stage_entry
from mmkey.cache.mooncake._transport import Lane, Pending, StoreTransport, TransferFailed
from mmkey._deadline import CallTimeout
from mmkey.entry.auth import FROM_ENV, EntryKeyring, FromEnv, keyring_for_cache
from mmkey.cache.health import CacheHealth
from mmkey.entry.codec import (
    encode_entry,
    encode_entry_into,
    entry_header,
    entry_size,
    largest_entry_size,
    payload_runs,
    verify_entry,
    verify_entry_into,
)
from mmkey.cache.mooncake.config import MooncakeConfig
from mmkey.cache.protocol import CacheStats
from mmkey.errors import CorruptEntry, ForgedEntry, StoreClosed, StoreError
from mmkey.keys import CacheKey

if TYPE_CHECKING:
    import torch
    from mooncake.store import MooncakeDistributedStore, ReplicaDescriptor, ReplicateConfig

__all__ = ["MooncakeCache", "MooncakeConfig"]

_RPC_FAILURES = frozenset({-900, -901})
"""Codes that mean the master did not answer (RPC_FAIL, RPC_TIMEOUT)."""
_BUFFER_TOO_SMALL = -600
_TRANSFER_FAILURES = range(-899, -799)
"""Codes of a transfer that reached the master but not the holder (TRANSFER_FAIL, -800...)."""
_Sink = Callable[[str, memoryview], bool]
"""Takes one entry read (its key text, its bytes, which it must not keep: they may lie in
memory registered with the store); returns whether it verified."""
_Bounds = Callable[[str], int]
"""The most bytes an entry under a key may have to be read at all."""
_UNKNOWN = ""
"""The holder group of keys read before any failure, without looking their holders up."""
_GROUPED_S = 60.0
"""How long after a failed transfer reads look up each key's holder first."""
_LOG = logging.getLogger("mmkey.cache.mooncake")
_LOG_EVERY_S = 10.0
_INSTALL_HINT = (
    "install the binding: pip install 'mmkey[mooncake-cpu]' on CPU machines (plus Debian's "
    "libibverbs1 libnuma1 libcurl4) or 'mmkey[mooncake]' on GPU machines"
)


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


def _out_of_time(give_up: float) -> None:
    if time.monotonic() >= give_up:
        raise TimeoutError("the call's deadline passed; the rest is not transferred")


def _release(staging: Staging, _: object) -> None:
    """Release the lease an abandoned transfer returned with."""
    staging.lease.release()


_PUT_CHUNK = 64 << 20
"""Payload bytes sealed and sent per multi-buffer put."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _put_chunks(payloads: dict[str, list[torch.Tensor]]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """`payloads` in runs of at most `_PUT_CHUNK` bytes (or one payload)."""
    chunk: dict[str, list[torch.Tensor]] = {}
    total = 0
    for text, runs in payloads.items():
        size = sum(_nbytes(t) for t in runs)
        if chunk and total + size > _PUT_CHUNK:
            yield chunk
            chunk, total = {}, 0
        chunk[text] = runs
        total += size
    if chunk:
        yield chunk


def _target_runs(values: object, count: int, function: str, what: str) -> list[list[torch.Tensor]]:
    """One list of payload runs per key (see `read_into`), checked before anything moves;
    errors name `function` and `what`."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(
            f"{function}() takes a list of {what} (one per key), got {type(values).__name__}"
        )
    if len(values) != count:
        raise ValueError(f"{function}() got {count} keys and {len(values)} {what}")
    return [payload_runs(value, function, what) for value in values]


def _read_from(replicas: Sequence[ReplicaDescriptor]) -> str | None:
    """The holder a read goes to: the first in-memory replica the master lists (Mooncake
    reads that one and does not fail over within a call); ``None`` when there is none."""
    return next(iter(memory_endpoints(replicas)), None)


class MooncakeCache:
    """A strict, fault-tolerant `EmbeddingCache` over ``mooncake.store``.

    Store failures never raise into the caller: reads become misses, inserts report
    ``False``, and both are counted in ``stats().errors``. Every call returns within
    ``config.deadline`` (one deadline per call, however many transfers it takes). Only
    misuse raises: wrong key types (`TypeError`), mismatched lengths (`ValueError`), calls
    after `close` (`StoreClosed`), and a binding that cannot be imported (`StoreError`, at
    construction).

    Where entries live: in the memory segment of the process that wrote them (this cache
    lends ``config.global_segment_size`` bytes to the store). When that process closes its
    cache or exits, its entries are gone for every reader. To keep entries across restarts
    of the serving processes, run them as pure clients (``global_segment_size=0``) beside
    dedicated holder processes that lend the memory, and write ``replica_num`` > 1 copies
    so that one holder's death loses nothing.

    ``store_class`` is for tests: a stand-in for the binding's ``MooncakeDistributedStore``
    (`mmkey.testing.fake_mooncake.FakeMooncakeStore`); by default the binding's own.
    """

    def __init__(
        self,
        config: MooncakeConfig,
        *,
        keyring: EntryKeyring | FromEnv | None = FROM_ENV,
        store_class: type[MooncakeDistributedStore] | None = None,
    ) -> None:
        value: object = config
        if not isinstance(value, MooncakeConfig):
            raise TypeError(
                f"MooncakeCache takes a MooncakeConfig, got {type(value).__name__}; "
                "use MooncakeConfig(master_server_address='host:port') or MooncakeConfig.from_env()"
            )
        try:
            if store_class is None:
                from mooncake.store import MooncakeDistributedStore

                store_class = MooncakeDistributedStore
        except ImportError as exc:
            raise StoreError(f"the Mooncake binding cannot be imported ({exc}); {_INSTALL_HINT}") from None
        self._config = config
        self._keyring = keyring_for_cache(keyring, "MooncakeCache", shared=True)
        self._counts = Counters()
        self._closed = False
        self._skips = RateLimitedLog(
            _LOG, logging.WARNING, "Mooncake calls answered as misses without the store: %s%s", period=_LOG_EVERY_S
        )
        self._refusals = RateLimitedLog(
            _LOG, logging.WARNING, "Mooncake entries that did not verify, served as misses: %s%s", period=_LOG_EVERY_S
        )
        self._transport = StoreTransport(
            config, store_class, functools.partial(self._counts.add, errors=1), self._skipped_by_breaker
        )
        self._replicas: ReplicateConfig | None = None  # made on first write
        self._grouped_until = 0.0  # reads look holders up until then (after a failure)
        self._told_untrusted = False
        give_up = time.monotonic() + config.setup_deadline
        self._warm_codec()
        self._transport.connect(give_up)

    def _warm_codec(self) -> None:
        """Load what the first entry written needs (the codec's runtime, the MAC's hash) now,
        at construction, rather than on the first call: on a busy host an import waits on disk."""
        import torch

        encode_entry("mmk1@warm-up@image@blake3@" + "0" * 32, torch.zeros(1), keyring=self._keyring)

    @property
    def config(self) -> MooncakeConfig:
        """The configuration this cache was made with."""
        return self._config

    @property
    def keyring(self) -> EntryKeyring | None:
        """The secrets entries are signed and verified with; None when they are not."""
        return self._keyring

    def is_connected(self) -> bool:
        """Whether the store is set up and the last call to the master succeeded."""
        return self._transport.is_connected()

    def health(self) -> CacheHealth:
        """The breaker, the quarantined holders and the lanes stuck past the deadline."""
        return CacheHealth(
            breaker_open=self._transport.breaker.is_open(),
            quarantined=self._transport.quarantine.endpoints(),
            busy_lanes=self._transport.busy_lanes(),
        )

    # -- the EmbeddingCache protocol ------------------------------------------------------

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held by the store; `False` when the store is unreachable."""
        texts = self._texts(keys, "batch_is_exist")
        if not texts:
            return []
        codes = self._transport.meta(lambda store: store.batch_is_exist(texts), self._give_up())
        if codes is None:
            return [False] * len(texts)
        if not _RPC_FAILURES.isdisjoint(codes):
            self._transport.fail()
        return [code == 1 for code in codes]

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The verified embedding of each key, or None (a miss, a corrupt entry, a fault).

        Each tensor holds exactly the bytes that verified, copied out of the registered
        staging buffer as they were hashed. Entries larger than ``config.max_entry_size``
        are misses, never fetched. A key given twice gets two distinct tensors.
        """
        texts = self._texts(keys, "get_embeddings")
        unique = list(dict.fromkeys(texts))
        found: dict[str, torch.Tensor] = {}
        if unique:
            limit = self._config.max_entry_size
            self._read(
                unique, self._give_up(), functools.partial(self._decode_into, found), lambda _: limit
            )
        result: list[torch.Tensor | None] = []
        handed: set[str] = set()
        for text in texts:
            tensor = found.get(text)
            if tensor is not None:
                if text in handed:
                    tensor = tensor.clone()
                handed.add(text)
            result.append(tensor)
        hits = sum(t is not None for t in result)
        self._counts.add(hits=hits, misses=len(result) - hits)
        return result

    def insert_batch(
        self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]
    ) -> list[bool]:
        """Store each embedding under its key, replacing what was there; whether each is stored.

        A key given twice in one batch stores its last embedding.
        """
        give_up = self._give_up()  # the deadline counts from the call, checks included
        self._check_open()
        texts, tensors = insert_args(keys, embeddings)
        latest = dict(zip(texts, tensors))
        stored = self._write(list(latest), list(latest.values()), give_up) if latest else {}
        self._counts.add(inserts=sum(stored.values()))
        return [stored.get(text, False) for text in texts]

    def register_memory(self, tensor: torch.Tensor) -> None:
        """Register a contiguous host tensor (e.g. an embedding pool) with the store, so that
        `insert_from` sends entries straight from it, when ``config.trusted_network`` is
        set; otherwise do nothing, and `insert_from` sends entries through staging.

        Memory registered with Mooncake is writable by anyone who reaches this process's
        transfer ports (no authentication exists there), so caller memory is registered
        only on a network where every host is trusted. Registered again whenever the store
        is set up; the tensor is kept referenced until `close`. Raises `TypeError` for a
        tensor that is not contiguous CPU memory, `ValueError` for memory that overlaps
        memory registered before."""
        import torch

        self._check_open()
        value: object = tensor
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"register_memory() takes a torch.Tensor, got {type(value).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            raise TypeError(
                "register_memory() takes a non-empty contiguous CPU tensor, got shape "
                f"{tuple(tensor.shape)} on {tensor.device}"
            )
        if not self._config.trusted_network:
            if not self._told_untrusted:
                self._told_untrusted = True
                _LOG.info(
                    "register_memory: not registered (trusted_network is off: registered "
                    "memory is writable from the network); puts go through staging"
                )
            return
        self._transport.register_memory(tensor)

    def read_into(
        self,
        keys: Sequence[CacheKey],
        targets: Sequence[torch.Tensor | Sequence[torch.Tensor]],
    ) -> list[bool]:
        """Read each key's verified embedding into its target; whether each landed.

        A target is a tensor of the entry's dtype and shape, or a list of tensors (e.g.
        pages of a pool) whose concatenation along the first dimension is; contiguous CPU
        memory, written only with an entry that verified (a miss, a corrupt or forged entry,
        one of another dtype or shape, or a fault leaves it as it was). Entries move through
        this cache's own staging buffers, never straight into the targets: a transfer the
        deadline gave up on can still land much later (Mooncake cannot cancel one), and it
        must not land in memory the caller has since reused.
        """
        texts = self._texts(keys, "read_into")
        plans = _target_runs(targets, len(texts), "read_into", "targets")
        landed: set[int] = set()
        by_text: dict[str, list[int]] = {}  # a key given twice fills both targets
        bounds: dict[str, int] = {}  # the largest entry each key's targets can take
        for i, (text, runs) in enumerate(zip(texts, plans)):
            by_text.setdefault(text, []).append(i)
            nbytes = sum(_nbytes(t) for t in runs)
            bounds[text] = max(bounds.get(text, 0), largest_entry_size(text, nbytes, runs[0].dim()))

        def sink(text: str, raw: memoryview) -> bool:
            refused: CorruptEntry | None = None
            unsigned = False
            for i in by_text[text]:
                try:
                    unsigned = verify_entry_into(text, raw, plans[i], keyring=self._keyring)
                except CorruptEntry as exc:  # ForgedEntry included
                    refused = exc
                else:
                    landed.add(i)
            if refused is not None:  # counted once per entry read
                self._refused(refused)
            elif unsigned:
                self._counts.add(unsigned_served=1)
            return refused is None

        if by_text:
            self._read(list(by_text), self._give_up(), sink, bounds.__getitem__)
        result = [i in landed for i in range(len(texts))]
        hits = sum(result)
        self._counts.add(hits=hits, misses=len(result) - hits)
        return result

    def insert_from(
        self,
        keys: Sequence[CacheKey],
        payloads: Sequence[torch.Tensor | Sequence[torch.Tensor]],
    ) -> list[bool]:
        """Store each payload under its key, replacing what was there; whether each is stored.

        A payload is one tensor, or a list of tensors (e.g. pages of a pool) that make the
        embedding when concatenated along the first dimension; contiguous CPU memory. When
        every tensor of a payload lies in memory given to `register_memory` and its key is
        not in the store yet, the entry goes to the store straight from that memory (its
        header from this cache's staging buffer, in one multi-buffer put); otherwise it is
        joined into the staging buffer first. The payload must not change until this
        returns; if it does, the stored entry fails its checksum (a miss, never a wrong
        embedding). A key given twice in one batch stores its last payload.
        """
        self._check_open()
        texts = key_texts(keys, "insert_from")
        plans = _target_runs(payloads, len(texts), "insert_from", "payloads")
        latest = dict(zip(texts, plans))
        stored = self._write_from(latest, self._give_up()) if latest else {}
        self._counts.add(inserts=sum(stored.values()))
        return [stored.get(text, False) for text in texts]

    def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """How many of the keys the store holds (a remote store has no nearer tier)."""
        return sum(self.batch_is_exist(keys))

    def stats(self) -> CacheStats:
        """Hits, misses, inserts, corrupt and forged entries, store errors and calls answered
        without the store since creation. `entries` and `bytes_held` are ``None``: the entries
        live in the store's holders, and this client cannot know how many of them are held."""
        self._check_open()
        # the entries live in the store's holders, not here
        return CacheStats(**self._counts.totals(), bytes_held=None, entries=None)

    def close(self) -> None:
        """Close the store; later calls raise `StoreClosed`, calls in flight return at once.

        Waits at most ``config.deadline`` for the worker. Mooncake's own close holds the GIL
        (every thread of the process stops for it: about 1 s for a pure client, 2 s with a
        segment, measured), so it runs only right after the master answered a request; a
        store whose master does not answer is left open, unreachable, until the process
        exits, rather than freezing the process for tens of seconds.
        """
        if self._closed:
            return
        self._closed = True
        self._transport.close()

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
        auth = "" if self._keyring is None else f", key_id={self._keyring.current.key_id.hex()}"
        return f"MooncakeCache({self._config.master_server_address!r}, {state}{auth})"

    # -- reads and writes: transfers on the worker, through the staging buffer -------------

    def _give_up(self) -> float:
        return time.monotonic() + self._config.deadline

    def _skipped_by_breaker(self) -> None:
        self._counts.add(skipped=1)
        self._skips.note("master unreachable (breaker open)")

    def _read(self, texts: list[str], give_up: float, sink: _Sink, bound: _Bounds) -> None:
        """Hand `sink` each entry found, all within one deadline.

        No entry larger than ``bound(key)`` is transferred: a batch's slots are no larger
        than its keys' largest bound, and an entry that does not fit its slot is read alone
        only after the store's size for it (``get_size``) is within its bound; larger ones
        are misses, counted as ``oversized``. The slot size learns only from entries that
        verified.

        While every holder is healthy, keys go to the store in one transfer per staging
        buffer (holders unknown). Once a transfer failed, and while any holder is quarantined
        or for `_GROUPED_S` seconds after the last failure, the master's replica list first
        says which holder each read goes to (Mooncake reads the first listed replica): keys
        absent from it are misses without a transfer, keys bound for a quarantined holder are
        misses at once, and the rest are read per holder. Each holder has one transfer under
        way at a time, as large as a staging buffer allows, on a lane of its own, so holders
        move in parallel. The caller's thread verifies each transfer's entries (holding the
        lane's lease; results land where the caller lives) before that holder's next
        transfer: measured on loopback, smaller transfers overlapped with verification, and
        concurrent transfers from one holder, were both slower (each call costs milliseconds,
        and verification competes with the transfer for the same cores).
        """
        quarantine = self._transport.quarantine
        if quarantine or time.monotonic() < self._grouped_until:
            grouped = self._group_by_holder(texts, give_up)
            if grouped is None:
                return
            groups = grouped
        elif self._transport.ready(give_up):  # the breaker, and the master if a call failed
            groups = {_UNKNOWN: list(texts)}
        else:
            return
        too_big: dict[str, list[str]] = {}
        taken: set[int] = set()
        inflight: deque[tuple[str, list[str], int, Pending[tuple[memoryview, list[int]]]]] = deque()

        def submit_more() -> None:
            moving = {endpoint for endpoint, *_ in inflight}  # one transfer per holder at a time
            for endpoint in [e for e in groups if e not in moving]:
                if time.monotonic() >= give_up:
                    return
                lane = self._transport.pick_lane(taken)
                if lane is None:
                    return
                pending = groups.pop(endpoint)
                slots = lane.staging.slots
                chunk = pending[: slots.keys_per_transfer()]
                del pending[: len(chunk)]
                if pending:
                    groups[endpoint] = pending
                slot = min(slots.slot_for(len(chunk)), aligned(max(map(bound, chunk))))
                work = functools.partial(
                    self._transfer_on_worker, chunk=chunk, slot=slot, give_up=give_up
                )
                inflight.append((endpoint, chunk, slot, self._transport.submit(lane, work)))

        submit_more()
        if groups and not inflight and time.monotonic() < give_up:
            self._counts.add(skipped=1)
            self._skips.note("every transfer lane stuck")
        while inflight:
            endpoint, chunk, slot, pending_transfer = inflight.popleft()
            lane = pending_transfer.lane
            outcome = self._transport.finish(
                pending_transfer, give_up, abandoned=functools.partial(_release, lane.staging)
            )
            if isinstance(outcome, BaseException):
                self._holder_failed(endpoint, chunk, outcome)
                groups.pop(endpoint, None)
                continue  # the lane stays taken: it may still be stuck
            failed = self._decode_chunk(
                sink, lane, chunk, slot, outcome, too_big.setdefault(endpoint, []), bound
            )
            taken.discard(self._transport.lanes.index(lane))
            if failed:
                self._holder_failed(endpoint, failed, TransferFailed("transfer failed"))
                groups.pop(endpoint, None)
            submit_more()
        for endpoint, large in too_big.items():
            large_lane = self._transport.pick_lane(set())
            if not large or large_lane is None or time.monotonic() >= give_up:
                continue
            work_large = functools.partial(
                self._read_large_on_worker, texts=large, give_up=give_up, bound=bound
            )
            got = self._transport.finish(self._transport.submit(large_lane, work_large), give_up)
            if isinstance(got, BaseException):
                self._holder_failed(endpoint, large, got)
                continue
            buffers, oversized = got
            for text, size in oversized.items():
                self._oversized(text, size, bound(text))
            largest = 0
            for text, buf in buffers.items():
                if sink(text, byte_view(buf, writable=True)):
                    largest = max(largest, buf.numel())
            large_lane.staging.slots.observe(largest)

    def _group_by_holder(self, texts: list[str], give_up: float) -> dict[str, list[str]] | None:
        """The keys by the holder a read of each goes to, leaving out keys the master does not
        hold and keys bound for a quarantined holder; ``None`` if the master did not answer."""
        placed = self._transport.meta(lambda store: store.batch_get_replica_desc(texts), give_up)
        if placed is None:
            return None
        quarantine = self._transport.quarantine
        groups: dict[str, list[str]] = {}
        bound_for_quarantine = 0
        for text in texts:
            replicas = placed.get(text)
            endpoint = _read_from(replicas) if replicas else None
            if endpoint is None:
                continue  # the master holds no copy: a miss
            if quarantine.holds(endpoint):
                bound_for_quarantine += 1
                continue
            groups.setdefault(endpoint, []).append(text)
        if bound_for_quarantine:
            self._counts.add(skipped=1)
            self._skips.note("holder quarantined")
        if quarantine:
            self._probe_quarantined()
        return groups

    def _decode_chunk(
        self,
        sink: _Sink,
        lane: Lane,
        chunk: list[str],
        slot: int,
        moved: tuple[memoryview, list[int]],
        too_big: list[str],
        bound: _Bounds,
    ) -> list[str]:
        """Hand one transfer's entries in the lane's staging buffer to `sink`, then release
        the buffer; returns the keys whose transfer failed (their holder did not answer)."""
        staging, codes = moved
        largest = 0
        failed: list[str] = []
        try:
            for i, (text, code) in enumerate(zip(chunk, codes)):
                if code > bound(text):
                    self._oversized(text, code, bound(text))
                elif code > 0:
                    if sink(text, staging[i * slot : i * slot + code]):
                        largest = max(largest, code)
                elif code == _BUFFER_TOO_SMALL:
                    too_big.append(text)
                elif code in _TRANSFER_FAILURES:
                    failed.append(text)
        finally:
            lane.staging.lease.release()
        lane.staging.slots.observe(largest)
        return failed

    def _holder_failed(self, endpoint: str, keys: list[str], why: BaseException) -> None:
        """A transfer of `keys` from `endpoint` timed out or failed: quarantine the holder.

        With the holder unknown (`_UNKNOWN`: read before any failure), reads look holders
        up for the next `_GROUPED_S` seconds, and a lookup on the metadata lane, queued
        ahead of any later read's own, quarantines the keys' holder if they share one.
        """
        if not isinstance(why, (CallTimeout, TransferFailed)):
            return
        self._grouped_until = time.monotonic() + _GROUPED_S
        if endpoint != _UNKNOWN:
            self._quarantine(endpoint, keys, why)
            return

        failed_at = time.monotonic()

        def attribute(store: MooncakeDistributedStore) -> None:
            left = failed_at + self._config.deadline - time.monotonic()
            if left <= 0 or not self._transport.master_answers(left):
                return  # stale (the store may have changed since), or the master is what failed
            placed = store.batch_get_replica_desc(keys)
            if time.monotonic() - failed_at > self._config.deadline:
                return
            holders = {_read_from(placed.get(k, ())) for k in keys} - {None}
            if len(holders) == 1:
                self._quarantine(holders.pop() or "", keys, why)

        self._transport.background(attribute)

    def _quarantine(self, endpoint: str, keys: list[str], why: BaseException) -> None:
        if self._transport.quarantine.add(endpoint, keys):
            _LOG.warning(
                "Mooncake holder %s quarantined: a transfer %s; reads bound for it are misses "
                "until it answers again or the master drops it",
                endpoint,
                "timed out" if isinstance(why, CallTimeout) else "failed",
            )

    def _probe_quarantined(self) -> None:
        for endpoint, keys in self._transport.quarantine.due_probes():
            probe = functools.partial(
                self._probe_on_worker,
                endpoint=endpoint,
                keys=keys,
                limit=self._config.max_entry_size,
            )
            self._transport.probe(probe, endpoint)

    @staticmethod
    def _probe_on_worker(
        store: MooncakeDistributedStore, endpoint: str, keys: list[str], limit: int
    ) -> bool:
        """Whether a quarantined holder may be read again: the master no longer lists it for
        the keys it failed on, or one of them (no larger than `limit`) reads back from it
        in full."""
        import torch

        placed = store.batch_get_replica_desc(keys)
        listed = [k for k in keys if endpoint in memory_endpoints(placed.get(k, ()))]
        if not listed:
            _LOG.warning("Mooncake holder %s re-admitted: the master no longer lists it", endpoint)
            return True
        size = store.get_size(listed[0])
        if size <= 0 or size > limit:
            return False
        buf = torch.empty(size, dtype=torch.uint8)
        with _registered(store, buf) as ptr:
            healthy = store.get_into(listed[0], ptr, size) == size
        if healthy:
            _LOG.warning("Mooncake holder %s re-admitted: it answers again", endpoint)
        return healthy

    def _transfer_on_worker(
        self,
        store: MooncakeDistributedStore,
        lane_staging: Staging,
        chunk: list[str],
        slot: int,
        give_up: float,
    ) -> tuple[memoryview, list[int]]:
        """Entries of `chunk` into staging slots of `slot` bytes; returns with the lease held."""
        staging = lane_staging.view(store)
        if not lane_staging.lease.acquire(timeout=max(give_up - time.monotonic(), 0.0)):
            raise TimeoutError("the staging buffer stayed busy past the call's deadline")
        try:
            _out_of_time(give_up)
            base = lane_staging.ptr
            ptrs = [base + i * slot for i in range(len(chunk))]
            codes = store.batch_get_into(chunk, ptrs, [slot] * len(chunk))
            if not _RPC_FAILURES.isdisjoint(codes):
                raise StoreError(f"batch_get_into: master unreachable ({codes})")
        except BaseException:
            lane_staging.lease.release()
            raise
        return staging, codes

    def _read_large_on_worker(
        self,
        store: MooncakeDistributedStore,
        lane_staging: Staging,
        texts: list[str],
        give_up: float,
        bound: _Bounds,
    ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Entries larger than a staging slot, each read into a byte buffer of its exact
        size once the store says that size is within its key's bound; returns those
        buffers, and the sizes of the entries left unread for being larger. Stops at the
        call's deadline."""
        import torch

        found: dict[str, torch.Tensor] = {}
        oversized: dict[str, int] = {}
        for text in texts:
            if time.monotonic() >= give_up:
                break
            size = store.get_size(text)
            if size in _RPC_FAILURES:
                raise StoreError(f"get_size: master unreachable ({size})")
            if size <= 0:
                continue
            if size > bound(text):
                oversized[text] = size
                continue
            try:
                buf = torch.empty(size, dtype=torch.uint8)
            except (MemoryError, RuntimeError):  # a huge foreign value: a miss, counted
                self._counts.add(errors=1)
                continue
            with _registered(store, buf) as ptr:
                got = store.get_into(text, ptr, size)
            if got in _RPC_FAILURES:
                raise StoreError(f"get_into: master unreachable ({got})")
            if got in _TRANSFER_FAILURES:
                raise TransferFailed(f"get_into: transfer failed ({got})")
            if got == size:
                found[text] = buf
        return found, oversized

    def _decode_into(self, found: dict[str, torch.Tensor], text: str, raw: memoryview) -> bool:
        """A `_Sink` that decodes into `found`: a private copy of exactly the bytes verified."""
        try:
            found[text], unsigned = verify_entry(text, raw, keyring=self._keyring)
        except CorruptEntry as exc:  # ForgedEntry included
            self._refused(exc)
            return False
        if unsigned:
            self._counts.add(unsigned_served=1)
        return True

    def _refused(self, exc: CorruptEntry) -> None:
        """Count and (rate-limited) log an entry that did not verify."""
        if isinstance(exc, ForgedEntry):
            self._counts.add(forged=1, **{exc.reason: 1})
            self._refusals.note(f"forged ({exc.reason})")
        else:
            self._counts.add(corrupt=1)
            self._refusals.note("corrupt or not the expected shape")

    def _oversized(self, text: str, size: int, bound: int) -> None:
        """Count (and log, rate-limited) an entry left unread for being larger than its
        reader can use: under a keyring it is forged (no genuine entry is that large)."""
        self._counts.add(oversized=1)
        message = f"entry for key {text[:120]!r} has {size} bytes, more than the {bound} read"
        self._refused(ForgedEntry(message) if self._keyring is not None else CorruptEntry(message))

    def _write(
        self, texts: list[str], tensors: list[torch.Tensor], give_up: float
    ) -> dict[str, bool]:
        """Upsert entries through the staging buffer on the worker, within one deadline."""
        keyring = self._keyring
        sizes = [entry_size(text, t, keyring=keyring) for text, t in zip(texts, tensors)]
        ready = host_ready(tensors)  # CUDA tensors: an event on the caller's current stream
        # The worker reads the caller's tensors only while holding `reading`, and never
        # after the caller stopped waiting (`released`): a caller that timed out may reuse
        # its tensors at once, and a late encode would store that new data under old keys.
        reading = threading.Lock()
        released = threading.Event()

        def encode(target: memoryview, text: str, tensor: torch.Tensor) -> None:
            with reading:
                if released.is_set():
                    raise StoreError("insert_batch stopped waiting; its tensors are not read")
                encode_entry_into(target, text, tensor, keyring=keyring)

        def stage(staging: Staging, at: int, size: int, text: str, tensor: torch.Tensor) -> None:
            with reading:
                if released.is_set():
                    raise StoreError("insert_batch stopped waiting; its tensors are not read")
                stage_entry(staging, at, size, text, tensor, keyring)

        def write(store: MooncakeDistributedStore, lane_staging: Staging) -> dict[str, bool]:
            ready.wait()  # the caller's kernels writing the tensors have finished
            lane_staging.view(store)  # prepared at set-up; this only checks
            if not lane_staging.lease.acquire(timeout=max(give_up - time.monotonic(), 0.0)):
                raise TimeoutError("the staging buffer stayed busy past the call's deadline")
            try:
                return fill_and_flush(store, lane_staging)
            finally:
                lane_staging.lease.release()

        def fill_and_flush(store: MooncakeDistributedStore, staging: Staging) -> dict[str, bool]:
            stored: dict[str, bool] = {}
            batch: list[tuple[str, int, int]] = []  # key text, offset, size
            used = 0
            for text, t, size in zip(texts, tensors, sizes):
                if size > staging.nbytes:
                    _out_of_time(give_up)
                    stored[text] = self._write_large_on_worker(store, text, t, size, encode)
                    continue
                if used + size > staging.nbytes:
                    _out_of_time(give_up)
                    stored.update(self._flush_on_worker(store, staging.ptr, batch))
                    batch, used = [], 0
                stage(staging, used, size, text, t)
                batch.append((text, used, size))
                used += aligned(size)
            stored.update(self._flush_on_worker(store, staging.ptr, batch))
            return stored

        try:
            if not self._transport.ready(give_up):
                return {}
            lane = self._transport.pick_lane(set())
            if lane is None:
                self._counts.add(skipped=1)
                self._skips.note("every transfer lane stuck")
                return {}
            outcome = self._transport.finish(self._transport.submit(lane, write), give_up)
            return {} if isinstance(outcome, BaseException) else outcome
        finally:
            # Flag first, then wait out the entry being staged right now, if any: a lane that
            # re-takes `reading` entry after entry would otherwise keep a late caller waiting
            # (the lock is not fair), well past its deadline on a busy host.
            released.set()
            with reading:
                pass

    def _write_from(
        self, latest: dict[str, list[torch.Tensor]], give_up: float
    ) -> dict[str, bool]:
        """Store payloads held in runs: straight from registered memory when the key is new,
        through staging otherwise (Mooncake's multi-buffer put never replaces an entry)."""
        direct: dict[str, list[torch.Tensor]] = {}
        staged: dict[str, list[torch.Tensor]] = {}
        for text, runs in latest.items():
            in_place = all(
                self._transport.region_of(t.data_ptr(), _nbytes(t)) is not None
                for t in runs
                if _nbytes(t)
            )
            (direct if in_place else staged)[text] = runs
        stored: dict[str, bool] = {}
        if direct:
            texts = list(direct)
            transport = self._transport

            def look(store: MooncakeDistributedStore) -> tuple[bool, list[int]]:
                return transport.register_regions(store), store.batch_is_exist(texts)

            looked = transport.meta(look, give_up)
            if looked is None:
                return stored
            registered, codes = looked
            if not _RPC_FAILURES.isdisjoint(codes):
                transport.fail()
                return stored
            for text, code in zip(texts, codes):
                if code == 1 or not registered:
                    staged[text] = direct.pop(text)
            stored.update(self._put_direct(direct, give_up))
        if staged:
            import torch

            tensors = [runs[0] if len(runs) == 1 else torch.cat(runs) for runs in staged.values()]
            stored.update(self._write(list(staged), tensors, give_up))
        return stored

    def _put_direct(
        self, payloads: dict[str, list[torch.Tensor]], give_up: float
    ) -> dict[str, bool]:
        """Multi-buffer puts of header (from a lane's staging) and payload runs (from the
        caller's registered memory), one chunk at a time: the caller's thread seals the next
        chunk while a lane moves the one before."""
        stored: dict[str, bool] = {}
        if not payloads or not self._transport.ready(give_up):
            return stored
        taken: set[int] = set()
        inflight: deque[Pending[dict[str, bool]]] = deque()

        def drain_one() -> None:
            pending = inflight.popleft()
            outcome = self._transport.finish(pending, give_up)
            if not isinstance(outcome, BaseException):
                stored.update(outcome)
                taken.discard(self._transport.lanes.index(pending.lane))

        for chunk in _put_chunks(payloads):
            if time.monotonic() >= give_up:
                break
            headers = {
                text: entry_header(text, runs, keyring=self._keyring) for text, runs in chunk.items()
            }
            while inflight:  # one put at a time: this chunk was sealed while the last moved
                drain_one()
            lane = self._transport.pick_lane(taken)
            if lane is None:
                self._counts.add(skipped=1)
                self._skips.note("every transfer lane stuck")
                break
            work = functools.partial(
                self._put_direct_on_worker, headers=headers, payloads=chunk, give_up=give_up
            )
            inflight.append(self._transport.submit(lane, work))
        while inflight:
            drain_one()
        return stored

    def _put_direct_on_worker(
        self,
        store: MooncakeDistributedStore,
        lane_staging: Staging,
        headers: dict[str, bytes],
        payloads: dict[str, list[torch.Tensor]],
        give_up: float,
    ) -> dict[str, bool]:
        staging = lane_staging.view(store)
        if not lane_staging.lease.acquire(timeout=max(give_up - time.monotonic(), 0.0)):
            raise TimeoutError("the staging buffer stayed busy past the call's deadline")
        try:
            _out_of_time(give_up)
            keys: list[str] = []
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            at = 0
            for text, head in headers.items():
                if at + len(head) > staging.nbytes:
                    break  # not written: reported as not stored
                staging[at : at + len(head)] = head
                runs = [t for t in payloads[text] if _nbytes(t)]
                keys.append(text)
                ptrs.append([lane_staging.ptr + at, *(t.data_ptr() for t in runs)])
                sizes.append([len(head), *(_nbytes(t) for t in runs)])
                at += aligned(len(head))
            codes = self._placed(store.batch_put_from_multi_buffers, keys, ptrs, sizes)
            return {text: code == 0 for text, code in zip(keys, codes)}
        finally:
            lane_staging.lease.release()

    def _placed(self, write: Callable[..., list[int]], *args: object) -> list[int]:
        """`write(*args)` (a batch write of the binding) with `config.replica_num` copies
        (Mooncake's default placement for one); `StoreError` if the master did not answer."""
        if self._config.replica_num == 1:
            codes = write(*args)
        else:
            codes = write(*args, self._replicate())
        if not _RPC_FAILURES.isdisjoint(codes):
            name = getattr(write, "__name__", "batch write")
            raise StoreError(f"{name}: master unreachable ({codes[0]})")
        return codes

    def _replicate(self) -> ReplicateConfig:
        """Mooncake's per-write placement settings: `config.replica_num` copies."""
        if self._replicas is None:
            from mooncake.store import ReplicateConfig

            replicas = ReplicateConfig()
            replicas.replica_num = self._config.replica_num
            self._replicas = replicas
        return self._replicas

    def _flush_on_worker(
        self, store: MooncakeDistributedStore, base: int, batch: list[tuple[str, int, int]]
    ) -> dict[str, bool]:
        if not batch:
            return {}
        keys = [text for text, _, _ in batch]
        ptrs = [base + offset for _, offset, _ in batch]
        sizes = [size for _, _, size in batch]
        codes = self._placed(store.batch_upsert_from, keys, ptrs, sizes)
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
        encode(byte_view(buf, writable=True), text, tensor)
        with _registered(store, buf) as ptr:
            if self._config.replica_num == 1:
                code = store.upsert_from(text, ptr, size)
            else:
                code = store.upsert_from(text, ptr, size, self._replicate())
        if code in _RPC_FAILURES:
            raise StoreError(f"upsert_from: master unreachable ({code})")
        return code == 0

    # -- checks ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this MooncakeCache is closed; create a new one")

    def _texts(self, keys: Sequence[CacheKey], method: str) -> list[str]:
        self._check_open()
        return key_texts(keys, method)
