"""Read scheduling for `MooncakeCache`: which holder each key is read from, in what transfers.

`Reader.read` moves entries from the store into the lanes' staging buffers and hands each
one to a sink (the facade's verifier), all within one call's give-up time. It owns what reads
decide on their own: when to look holders up first (after a failed transfer), which holders
are quarantined and when they are probed, and which entries are too large to read at all.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mmkey._deadline import CallTimeout
from mmkey._log import RateLimitedLog
from mmkey._tensors import byte_view
from mmkey.cache.mooncake._parts import LOG, LOG_EVERY_S, CacheParts
from mmkey.cache.mooncake._replicas import memory_endpoints
from mmkey.cache.mooncake._staging import Staging, aligned, registered
from mmkey.cache.mooncake._transport import (
    BUFFER_TOO_SMALL,
    RPC_FAILURES,
    TRANSFER_FAILURES,
    Lane,
    Pending,
    TransferFailed,
    out_of_time,
)
from mmkey.errors import CorruptEntry, ForgedEntry, StoreError

if TYPE_CHECKING:
    import torch
    from mooncake.store import MooncakeDistributedStore, ReplicaDescriptor

__all__ = ["Bounds", "Reader", "Sink"]

Sink = Callable[[str, memoryview], bool]
"""Takes one entry read (its key text, its bytes, which it must not keep: they may lie in
memory registered with the store); returns whether it verified."""
Bounds = Callable[[str], int]
"""The most bytes an entry under a key may have to be read at all."""
_UNKNOWN = ""
"""The holder group of keys read before any failure, without looking their holders up."""
_GROUPED_S = 60.0
"""How long after a failed transfer reads look up each key's holder first."""


def _read_from(replicas: Sequence[ReplicaDescriptor]) -> str | None:
    """The holder a read goes to: the first in-memory replica the master lists (Mooncake
    reads that one and does not fail over within a call); ``None`` when there is none."""
    return next(iter(memory_endpoints(replicas)), None)


def _holders_of(store: MooncakeDistributedStore, keys: list[str]) -> set[str]:
    """The holders reads of `keys` go to now (the master asked)."""
    placed = store.batch_get_replica_desc(keys)
    return {holder for k in keys if (holder := _read_from(placed.get(k, ()))) is not None}


class Reader:
    """Schedules the reads of one `MooncakeCache` over its transport.

    Counts into the cache's counters (``oversized``, ``corrupt``, ``forged``, ``skipped``,
    ``errors``).
    """

    def __init__(self, parts: CacheParts) -> None:
        self._parts = parts
        self._refusals = RateLimitedLog(
            LOG,
            logging.WARNING,
            "Mooncake entries that did not verify, served as misses: %s%s",
            period=LOG_EVERY_S,
        )
        self._grouped_until = 0.0  # reads look holders up until then (after a failure)

    def refused(self, exc: CorruptEntry) -> None:
        """Count an entry that did not verify; `read` logs the counts of its call's
        refusals, every kind with its count, in one line (rate-limited)."""
        if isinstance(exc, ForgedEntry):
            self._parts.counts.add(forged=1, **{exc.reason: 1})
            self._refusals.count(f"forged ({exc.reason})")
        else:
            self._parts.counts.add(corrupt=1)
            self._refusals.count("corrupt or not the expected shape")

    def read(self, texts: list[str], give_up: float, sink: Sink, bound: Bounds) -> None:
        """Hand `sink` each entry found, all within one timeout.

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

        Entries of the call that did not verify are logged together when it ends, every
        kind with its count.
        """
        try:
            self._read(texts, give_up, sink, bound)
        finally:
            self._refusals.report()

    def _read(self, texts: list[str], give_up: float, sink: Sink, bound: Bounds) -> None:
        """`read`, but for the report of the entries it refused."""
        quarantine = self._parts.transport.quarantine
        if quarantine or time.monotonic() < self._grouped_until:
            grouped = self._group_by_holder(texts, give_up)
            if grouped is None:
                return
            groups = grouped
        elif self._parts.transport.ready(give_up):  # the breaker, and the master if a call failed
            groups = {_UNKNOWN: list(texts)}
        else:
            return
        too_big: dict[str, list[str]] = {}
        taken: set[int] = set()
        inflight: deque[tuple[str, list[str], int, float, Pending[tuple[memoryview, list[int]]]]] = deque()

        def submit_more() -> None:
            moving = {endpoint for endpoint, *_ in inflight}  # one transfer per holder at a time
            for endpoint in [e for e in groups if e not in moving]:
                if time.monotonic() >= give_up:
                    return
                lane = self._parts.transport.pick_lane(taken)
                if lane is None:
                    return
                pending = groups.pop(endpoint)
                slots = lane.staging.slots
                chunk = pending[: slots.keys_per_transfer()]
                del pending[: len(chunk)]
                if pending:
                    groups[endpoint] = pending
                slot = min(slots.slot_for(len(chunk)), aligned(max(map(bound, chunk))))
                work = functools.partial(_transfer_on_worker, chunk=chunk, slot=slot, give_up=give_up)
                submitted = time.monotonic()
                inflight.append((endpoint, chunk, slot, submitted, self._parts.transport.submit(lane, work)))

        submit_more()
        if groups and not inflight and time.monotonic() < give_up:
            self._parts.skipped("every transfer lane stuck")
        while inflight:
            endpoint, chunk, slot, submitted, pending_transfer = inflight.popleft()
            lane = pending_transfer.lane
            outcome = self._parts.transport.finish(
                pending_transfer,
                give_up,
                abandoned=functools.partial(self._answered_late, endpoint, chunk, lane.staging),
            )
            if isinstance(outcome, BaseException):
                if not pending_transfer.future.cancelled():  # a cancelled one never asked the holder
                    self._holder_failed(endpoint, chunk, outcome, submitted)
                groups.pop(endpoint, None)
                continue  # the lane stays taken: it may still be stuck
            failed = self._decode_chunk(
                sink, lane, chunk, slot, outcome, too_big.setdefault(endpoint, []), bound
            )
            taken.discard(self._parts.transport.lanes.index(lane))
            if failed:
                self._holder_failed(endpoint, failed, TransferFailed("transfer failed"), submitted)
                groups.pop(endpoint, None)
            submit_more()
        for endpoint, large in too_big.items():
            large_lane = self._parts.transport.pick_lane(set())
            if not large or large_lane is None or time.monotonic() >= give_up:
                continue
            work_large = functools.partial(
                self._read_large_on_worker, texts=large, give_up=give_up, bound=bound
            )
            submitted = time.monotonic()
            got = self._parts.transport.finish(self._parts.transport.submit(large_lane, work_large), give_up)
            if isinstance(got, BaseException):
                self._holder_failed(endpoint, large, got, submitted)
                continue
            buffers, oversized = got
            for text, size in oversized.items():
                self._oversized(text, size, bound(text))
            largest = 0
            for text, buf in buffers.items():
                if sink(text, byte_view(buf, writable=True)):
                    largest = max(largest, buf.numel())
            large_lane.staging.slots.observe(largest)

    def _oversized(self, text: str, size: int, bound: int) -> None:
        """Count (and log, rate-limited) an entry left unread for being larger than its
        reader can use: under a keyring it is forged (no genuine entry is that large)."""
        self._parts.counts.add(oversized=1)
        message = f"entry for key {text[:120]!r} has {size} bytes, more than the {bound} read"
        self.refused(ForgedEntry(message) if self._parts.keyring is not None else CorruptEntry(message))

    def _group_by_holder(self, texts: list[str], give_up: float) -> dict[str, list[str]] | None:
        """The keys by the holder a read of each goes to, leaving out keys the master does not
        hold and keys bound for a quarantined holder; ``None`` if the master did not answer."""
        placed = self._parts.transport.meta(lambda store: store.batch_get_replica_desc(texts), give_up)
        if placed is None:
            return None
        quarantine = self._parts.transport.quarantine
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
            self._parts.skipped("holder quarantined")
        if quarantine:
            self._probe_quarantined()
        return groups

    def _decode_chunk(
        self,
        sink: Sink,
        lane: Lane,
        chunk: list[str],
        slot: int,
        moved: tuple[memoryview, list[int]],
        too_big: list[str],
        bound: Bounds,
    ) -> list[str]:
        """Hand one transfer's entries in the lane's staging buffer to `sink`, then release
        the buffer; returns the keys whose transfer failed (their holder did not answer)."""
        staging, codes = moved
        largest = 0
        failed: list[str] = []
        try:
            # strict=False: keys the binding's answer leaves out are misses
            for i, (text, code) in enumerate(zip(chunk, codes, strict=False)):
                if code > bound(text):
                    self._oversized(text, code, bound(text))
                elif code > 0:
                    if sink(text, staging[i * slot : i * slot + code]):
                        largest = max(largest, code)
                elif code == BUFFER_TOO_SMALL:
                    too_big.append(text)
                elif code in TRANSFER_FAILURES:
                    failed.append(text)
        finally:
            lane.staging.lease.release()
        lane.staging.slots.observe(largest)
        return failed

    def _answered_late(
        self, endpoint: str, keys: list[str], staging: Staging, moved: tuple[memoryview, list[int]]
    ) -> None:
        """A transfer of `keys` its caller gave up on returned: release its staging buffer,
        and re-admit its holder if no entry failed to move (it was slow, not stuck). With the
        holder unknown, a lookup on the metadata lane names the holders of `keys`."""
        staging.lease.release()
        if any(code in TRANSFER_FAILURES for code in moved[1]):
            return
        if endpoint != _UNKNOWN:
            self._readmit(endpoint)
            return

        def readmit_holders(store: MooncakeDistributedStore) -> None:
            for holder in _holders_of(store, keys):
                self._readmit(holder)

        self._parts.transport.background(readmit_holders)

    def _readmit(self, endpoint: str) -> None:
        if self._parts.transport.quarantine.answered(endpoint):
            LOG.warning("Mooncake holder %s re-admitted: a transfer that timed out completed", endpoint)

    def _holder_failed(self, endpoint: str, keys: list[str], why: BaseException, submitted: float) -> None:
        """A transfer of `keys` from `endpoint`, submitted at `submitted`, timed out or
        failed: quarantine the holder, unless it completed a late transfer since.

        With the holder unknown (`_UNKNOWN`: read before any failure), reads look holders
        up for the next `_GROUPED_S` seconds, and a lookup on the metadata lane, queued
        ahead of any later read's own, quarantines the keys' holder if they share one and it
        completed no late transfer since this one started.
        """
        if not isinstance(why, (CallTimeout, TransferFailed)):
            return
        self._grouped_until = time.monotonic() + _GROUPED_S
        if endpoint != _UNKNOWN:
            self._quarantine(endpoint, keys, why, submitted)
            return

        failed_at = time.monotonic()

        def attribute(store: MooncakeDistributedStore) -> None:
            left = failed_at + self._parts.config.timeout - time.monotonic()
            if left <= 0 or not self._parts.transport.master_answers(left):
                return  # stale (the store may have changed since), or the master is what failed
            holders = _holders_of(store, keys)
            if time.monotonic() - failed_at > self._parts.config.timeout:
                return
            if len(holders) == 1:
                self._quarantine(holders.pop(), keys, why, submitted)

        self._parts.transport.background(attribute)

    def _quarantine(self, endpoint: str, keys: list[str], why: BaseException, submitted: float) -> None:
        if self._parts.transport.quarantine.add(endpoint, keys, since=submitted):
            LOG.warning(
                "Mooncake holder %s quarantined: a transfer %s; reads bound for it are misses "
                "until it answers again or the master drops it",
                endpoint,
                "timed out" if isinstance(why, CallTimeout) else "failed",
            )

    def _probe_quarantined(self) -> None:
        for endpoint, keys in self._parts.transport.quarantine.due_probes():
            probe = functools.partial(
                _probe_on_worker, endpoint=endpoint, keys=keys, limit=self._parts.config.max_entry_size
            )
            self._parts.transport.probe(probe, endpoint)

    def _read_large_on_worker(
        self,
        store: MooncakeDistributedStore,
        lane_staging: Staging,
        texts: list[str],
        give_up: float,
        bound: Bounds,
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
            if size in RPC_FAILURES:
                raise StoreError(f"get_size: master unreachable ({size})")
            if size <= 0:
                continue
            if size > bound(text):
                oversized[text] = size
                continue
            try:
                buf = torch.empty(size, dtype=torch.uint8)
            except (MemoryError, RuntimeError):  # a huge foreign value: a miss, counted
                self._parts.counts.add(errors=1)
                continue
            with registered(store, buf) as ptr:
                got = store.get_into(text, ptr, size)
            if got in RPC_FAILURES:
                raise StoreError(f"get_into: master unreachable ({got})")
            if got in TRANSFER_FAILURES:
                raise TransferFailed(f"get_into: transfer failed ({got})")
            if got == size:
                found[text] = buf
        return found, oversized


def _transfer_on_worker(
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
        out_of_time(give_up)
        base = lane_staging.ptr
        ptrs = [base + i * slot for i in range(len(chunk))]
        codes = store.batch_get_into(chunk, ptrs, [slot] * len(chunk))
        if not RPC_FAILURES.isdisjoint(codes):
            raise StoreError(f"batch_get_into: master unreachable ({codes})")
    except BaseException:
        lane_staging.lease.release()
        raise
    return staging, codes


def _probe_on_worker(store: MooncakeDistributedStore, endpoint: str, keys: list[str], limit: int) -> bool:
    """Whether a quarantined holder may be read again: the master no longer lists it for
    the keys it failed on, or one of them (no larger than `limit`) reads back from it
    in full."""
    import torch

    placed = store.batch_get_replica_desc(keys)
    listed = [k for k in keys if endpoint in memory_endpoints(placed.get(k, ()))]
    if not listed:
        LOG.warning("Mooncake holder %s re-admitted: the master no longer lists it", endpoint)
        return True
    size = store.get_size(listed[0])
    if size <= 0 or size > limit:
        return False
    buf = torch.empty(size, dtype=torch.uint8)
    with registered(store, buf) as ptr:
        healthy = store.get_into(listed[0], ptr, size) == size
    if healthy:
        LOG.warning("Mooncake holder %s re-admitted: it answers again", endpoint)
    return healthy
