"""Reads for `MooncakeCache`: which holder each key is read from, in what transfers, and the
codec's check of every entry read.

`Reader.get` and `Reader.read_into` move entries from the store into the lanes' staging
buffers and verify each one there (`mmkey.entry.codec`: its checksum, or its MAC under a
keyring), all within one call's give-up time. The reader owns what reads decide on their
own: when to look holders up first (after a failed transfer), which holders are quarantined
and when they are probed, and which entries are too large to read at all.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from mmkey._deadline import Done, Failed, Why
from mmkey._log import RateLimitedLog
from mmkey._tensors import byte_view, nbytes_of
from mmkey.cache.mooncake._staging import Staging, _RegistrationRefused, aligned, registered
from mmkey.cache.mooncake._transport import (
    BUFFER_TOO_SMALL,
    LOG,
    LOG_EVERY_S,
    RPC_FAILURES,
    TRANSFER_FAILURES,
    CacheParts,
    Pending,
    TransferFailed,
)
from mmkey.entry.codec import largest_entry_size, verify
from mmkey.errors import CorruptEntry, ForgedEntry, StoreError

if TYPE_CHECKING:
    import torch
    from mooncake.store import MooncakeDistributedStore, ReplicaDescriptor

__all__ = ["Reader", "memory_endpoints"]

Sink = Callable[[str, memoryview], bool]
"""Takes one entry read (its key text, its bytes, which it must not keep: they may lie in
memory registered with the store); returns whether it verified."""
Bounds = Callable[[str], int]
"""The most bytes an entry under a key may have to be read at all."""
Moved = tuple[memoryview, list[int]]
"""What one batch transfer left: the staging buffer (its lease held) and the binding's codes."""
_UNKNOWN = ""
"""The holder group of keys read before any failure, without looking their holders up."""
_GROUPED_S = 60.0
"""How long after a failed transfer reads look up each key's holder first."""
_TRANSFER_FAILED = Failed(Why.RAISED, TransferFailed("transfer failed"))


def memory_endpoints(replicas: Sequence[ReplicaDescriptor]) -> list[str]:
    """Transfer endpoints of the in-memory replicas, in the master's order (Mooncake reads
    from the first and does not fail over within a call)."""
    found: list[str] = []
    for replica in replicas:
        with contextlib.suppress(Exception):  # a replica on disk has no memory descriptor
            found.append(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)
    return found


def _read_from(replicas: Sequence[ReplicaDescriptor]) -> str | None:
    """The holder a read goes to: the first in-memory replica the master lists (Mooncake
    reads that one and does not fail over within a call); ``None`` when there is none."""
    return next(iter(memory_endpoints(replicas)), None)


def _holders_of(store: MooncakeDistributedStore, keys: list[str]) -> set[str]:
    """The holders reads of `keys` go to now (the master asked)."""
    placed = store.batch_get_replica_desc(keys)
    return {holder for k in keys if (holder := _read_from(placed.get(k, ()))) is not None}


@attrs.define(slots=True)
class _Transfer:
    """One batch transfer under way: the keys it reads from one holder into one lane."""

    endpoint: str
    keys: list[str]
    slot: int
    submitted: float
    pending: Pending[Moved]


class Reader:
    """The reads of one `MooncakeCache` over its transport.

    Counts into the cache's counters (``oversized``, ``corrupt``, ``forged``, ``skipped``,
    ``errors``, ``unsigned_served``).
    """

    def __init__(self, parts: CacheParts) -> None:
        self._parts = parts
        self._transport = parts.transport
        self._refusals = RateLimitedLog(
            LOG,
            logging.WARNING,
            "Mooncake entries that did not verify, served as misses: %s%s",
            period=LOG_EVERY_S,
        )
        self._grouped_until = 0.0  # reads look holders up until then (after a failure)

    def get(self, texts: list[str], give_up: float) -> dict[str, torch.Tensor]:
        """The verified embedding of each key text found (distinct texts), each a private
        copy of exactly the bytes verified; at most ``config.max_entry_size`` bytes read each."""
        found: dict[str, torch.Tensor] = {}
        limit = self._parts.config.max_entry_size
        self._read(texts, give_up, functools.partial(self._decode, found), lambda _: limit)
        return found

    def read_into(self, texts: list[str], plans: list[list[torch.Tensor]], give_up: float) -> list[bool]:
        """Each key text's verified entry written into its target runs (``plans[i]`` for
        ``texts[i]``; a text given twice fills both); whether each landed. No entry larger
        than what its largest target takes (plus the largest header) is read."""
        by_text: dict[str, list[int]] = {}
        bounds: dict[str, int] = {}
        for i, (text, runs) in enumerate(zip(texts, plans, strict=True)):
            by_text.setdefault(text, []).append(i)
            nbytes = sum(nbytes_of(t) for t in runs)
            bounds[text] = max(bounds.get(text, 0), largest_entry_size(text, nbytes, runs[0].dim()))
        landed: set[int] = set()
        sink = functools.partial(self._decode_into, by_text, plans, landed)
        self._read(list(by_text), give_up, sink, bounds.__getitem__)
        return [i in landed for i in range(len(texts))]

    def refused(self, exc: CorruptEntry) -> None:
        """Count an entry that did not verify; the read logs the counts of its call's
        refusals, every kind with its count, in one line (rate-limited)."""
        if isinstance(exc, ForgedEntry):
            self._parts.counts.add(forged=1, **{exc.reason: 1})
            self._refusals.count(f"forged ({exc.reason})")
        else:
            self._parts.counts.add(corrupt=1)
            self._refusals.count("corrupt or not the expected shape")

    # -- the two sinks: the codec's check of one entry in staging --------------------------

    def _decode(self, found: dict[str, torch.Tensor], text: str, raw: memoryview) -> bool:
        try:
            found[text], unsigned = verify(text, raw, keyring=self._parts.keyring)
        except CorruptEntry as exc:  # ForgedEntry included
            self.refused(exc)
            return False
        if unsigned:
            self._parts.counts.add(unsigned_served=1)
        return True

    def _decode_into(
        self,
        by_text: dict[str, list[int]],
        plans: list[list[torch.Tensor]],
        landed: set[int],
        text: str,
        raw: memoryview,
    ) -> bool:
        refused: CorruptEntry | None = None
        unsigned = False
        for i in by_text[text]:
            try:
                _, unsigned = verify(text, raw, plans[i], keyring=self._parts.keyring)
            except CorruptEntry as exc:  # ForgedEntry included
                refused = exc
            else:
                landed.add(i)
        if refused is not None:  # counted once per entry read
            self.refused(refused)
        elif unsigned:
            self._parts.counts.add(unsigned_served=1)
        return refused is None

    # -- scheduling ------------------------------------------------------------------------

    def _read(self, texts: list[str], give_up: float, sink: Sink, bound: Bounds) -> None:
        """Hand `sink` each entry found, all within one timeout; log the call's refusals.

        No entry larger than ``bound(key)`` is transferred: a batch's slots are no larger
        than its keys' largest bound, an entry larger than its own key's bound that fits the
        slot is not handed over, and an entry that does not fit its slot is read alone only
        after the store's size for it (``get_size``) is within its bound; larger ones are
        misses, counted as ``oversized``. The slot size learns only from entries that
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
        try:
            groups = self._groups(texts, give_up)
            if groups is None:
                return
            too_big: dict[str, list[str]] = {}
            taken: set[int] = set()
            moving: deque[_Transfer] = deque()
            self._start(groups, moving, taken, give_up, bound)
            if groups and not moving and self._transport.clock() < give_up:
                self._parts.skipped("every transfer lane stuck")
            while moving:
                transfer = moving.popleft()
                lane = transfer.pending.lane
                late = functools.partial(self._answered_late, transfer.endpoint, transfer.keys, lane.staging)
                outcome = self._transport.finish(transfer.pending, give_up, abandoned=late)
                if isinstance(outcome, Failed):
                    if outcome.why is not Why.NOT_STARTED:  # one never started never asked the holder
                        self._holder_failed(transfer.endpoint, transfer.keys, outcome, transfer.submitted)
                    groups.pop(transfer.endpoint, None)
                    continue  # the lane stays taken: it may still be stuck
                larger = too_big.setdefault(transfer.endpoint, [])
                failed = self._hand_over(sink, transfer, outcome.value, larger, bound)
                taken.discard(self._transport.lanes.index(lane))
                if failed:
                    self._holder_failed(transfer.endpoint, failed, _TRANSFER_FAILED, transfer.submitted)
                    groups.pop(transfer.endpoint, None)
                self._start(groups, moving, taken, give_up, bound)
            for endpoint, large in too_big.items():
                if large:
                    self._read_large(endpoint, large, give_up, sink, bound)
        finally:
            self._refusals.report()

    def _groups(self, texts: list[str], give_up: float) -> dict[str, list[str]] | None:
        """The keys to read by holder (`_UNKNOWN` while every holder is healthy); ``None``
        when the store is not asked at all."""
        if self._transport.quarantine or self._transport.clock() < self._grouped_until:
            return self._group_by_holder(texts, give_up)
        if self._transport.ready(give_up):  # the breaker, and the master if a call failed
            return {_UNKNOWN: list(texts)}
        return None

    def _start(
        self,
        groups: dict[str, list[str]],
        moving: deque[_Transfer],
        taken: set[int],
        give_up: float,
        bound: Bounds,
    ) -> None:
        """Submit the next transfer of every holder with none under way, on a lane each."""
        busy = {transfer.endpoint for transfer in moving}  # one transfer per holder at a time
        for endpoint in [e for e in groups if e not in busy]:
            if self._transport.clock() >= give_up:
                return
            lane = self._transport.pick_lane(taken)
            if lane is None:
                return
            keys = groups.pop(endpoint)
            slots = lane.staging.slots
            chunk, rest = keys[: slots.keys_per_transfer()], keys[slots.keys_per_transfer() :]
            if rest:
                groups[endpoint] = rest
            slot = min(slots.slot_for(len(chunk)), aligned(max(map(bound, chunk))))
            work = functools.partial(
                _transfer_on_worker, chunk=chunk, slot=slot, give_up=give_up, clock=self._transport.clock
            )
            submitted = self._transport.clock()
            moving.append(_Transfer(endpoint, chunk, slot, submitted, self._transport.submit(lane, work)))

    def _hand_over(
        self, sink: Sink, transfer: _Transfer, moved: Moved, too_big: list[str], bound: Bounds
    ) -> list[str]:
        """Hand one transfer's entries in the lane's staging buffer to `sink`, then release
        the buffer; returns the keys whose transfer failed (their holder did not answer)."""
        staging, codes = moved
        slot = transfer.slot
        largest = 0
        failed: list[str] = []
        try:
            # strict=False: keys the binding's answer leaves out are misses
            for i, (text, code) in enumerate(zip(transfer.keys, codes, strict=False)):
                if code > (limit := bound(text)):  # fits the batch's slot, not its own reader
                    self._oversized(text, code, limit)
                elif code > 0:
                    at = i * slot
                    if sink(text, staging[at : at + code]) and code > largest:
                        largest = code
                elif code == BUFFER_TOO_SMALL:
                    too_big.append(text)
                elif code in TRANSFER_FAILURES:
                    failed.append(text)
        finally:
            transfer.pending.lane.staging.lease.release()
        transfer.pending.lane.staging.slots.observe(largest)
        return failed

    def _read_large(self, endpoint: str, texts: list[str], give_up: float, sink: Sink, bound: Bounds) -> None:
        """Entries larger than a staging slot, one by one on a lane of their own."""
        lane = self._transport.pick_lane(set())
        if lane is None or self._transport.clock() >= give_up:
            return
        work = functools.partial(self._read_large_on_worker, texts=texts, give_up=give_up, bound=bound)
        submitted = self._transport.clock()
        outcome = self._transport.finish(self._transport.submit(lane, work), give_up)
        if isinstance(outcome, Failed):
            self._holder_failed(endpoint, texts, outcome, submitted)
            return
        buffers, oversized = outcome.value
        for text, size in oversized.items():
            self._oversized(text, size, bound(text))
        largest = 0
        for text, buf in buffers.items():
            if sink(text, byte_view(buf, writable=True)):
                largest = max(largest, buf.numel())
        lane.staging.slots.observe(largest)

    def _oversized(self, text: str, size: int, bound: int) -> None:
        """Count (and log, rate-limited) an entry left unread for being larger than its
        reader can use: under a keyring it is forged (no genuine entry is that large)."""
        self._parts.counts.add(oversized=1)
        message = f"entry for key {text[:120]!r} has {size} bytes, more than the {bound} read"
        self.refused(ForgedEntry(message) if self._parts.keyring is not None else CorruptEntry(message))

    def _group_by_holder(self, texts: list[str], give_up: float) -> dict[str, list[str]] | None:
        """The keys by the holder a read of each goes to, leaving out keys the master does not
        hold and keys bound for a quarantined holder; ``None`` if the master did not answer."""
        looked = self._transport.meta(lambda store: store.batch_get_replica_desc(texts), give_up)
        if not isinstance(looked, Done):
            return None
        placed = looked.value
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
            self._parts.skipped("holder quarantined")
        if quarantine:
            self._probe_quarantined()
        return groups

    def _answered_late(self, endpoint: str, keys: list[str], staging: Staging, moved: Moved) -> None:
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

        self._transport.background(readmit_holders)

    def _readmit(self, endpoint: str) -> None:
        if self._transport.quarantine.answered(endpoint):
            LOG.warning("Mooncake holder %s re-admitted: a transfer that timed out completed", endpoint)

    def _holder_failed(self, endpoint: str, keys: list[str], why: Failed, submitted: float) -> None:
        """A transfer of `keys` from `endpoint`, submitted at `submitted`, timed out or
        failed (`TransferFailed`): quarantine the holder, unless it completed a late transfer
        since. Other failures (the master's, a closed store) say nothing of the holder.

        With the holder unknown (`_UNKNOWN`: read before any failure), reads look holders
        up for the next `_GROUPED_S` seconds, and a lookup on the metadata lane, queued
        ahead of any later read's own, quarantines the keys' holder if they share one and it
        completed no late transfer since this one started.
        """
        if why.why is not Why.TIMED_OUT and not isinstance(why.error, TransferFailed):
            return
        clock = self._transport.clock
        self._grouped_until = clock() + _GROUPED_S
        if endpoint != _UNKNOWN:
            self._quarantine(endpoint, keys, why, submitted)
            return

        failed_at = clock()

        def attribute(store: MooncakeDistributedStore) -> None:
            left = failed_at + self._parts.config.timeout - clock()
            if left <= 0 or not self._transport.master_answers(left):
                return  # stale (the store may have changed since), or the master is what failed
            holders = _holders_of(store, keys)
            if clock() - failed_at > self._parts.config.timeout:
                return
            if len(holders) == 1:
                self._quarantine(holders.pop(), keys, why, submitted)

        self._transport.background(attribute)

    def _quarantine(self, endpoint: str, keys: list[str], why: Failed, submitted: float) -> None:
        if self._transport.quarantine.add(endpoint, keys, since=submitted):
            LOG.warning(
                "Mooncake holder %s quarantined: a transfer %s; reads bound for it are misses "
                "until it answers again or the master drops it",
                endpoint,
                "timed out" if why.why is Why.TIMED_OUT else "failed",
            )

    def _probe_quarantined(self) -> None:
        for endpoint, keys in self._transport.quarantine.due_probes():
            probe = functools.partial(
                _probe_on_worker, endpoint=endpoint, keys=keys, limit=self._parts.config.max_entry_size
            )
            self._transport.probe(probe, endpoint)

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
            if self._transport.clock() >= give_up:
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
            try:
                with registered(store, buf) as ptr:
                    got = store.get_into(text, ptr, size)
            except _RegistrationRefused:  # this client's memory: a miss, counted, no store fault
                self._parts.counts.add(errors=1)
                continue
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
    clock: Callable[[], float],
) -> Moved:
    """Entries of `chunk` into staging slots of `slot` bytes; returns with the lease held."""
    staging = lane_staging.view(store)
    if not lane_staging.lease.acquire(timeout=max(give_up - clock(), 0.0)):
        raise TimeoutError("the staging buffer stayed busy past the call's deadline")
    try:
        if clock() >= give_up:
            raise TimeoutError("the call's deadline passed; nothing is transferred")
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
    try:
        with registered(store, buf) as ptr:
            healthy = store.get_into(listed[0], ptr, size) == size
    except _RegistrationRefused:  # not read back: it stays quarantined
        return False
    if healthy:
        LOG.warning("Mooncake holder %s re-admitted: it answers again", endpoint)
    return healthy
