"""Write pipelines for `MooncakeCache`: entries sealed into staging, or sent from registered memory.

`Writer.write` seals entries into a lane's staging buffer and upserts them in batches (an
entry larger than the buffer gets a registered buffer of its own). `Writer.write_from` sends
payloads that lie in memory registered with the store straight from it, a header from
staging beside them, when the key is new (Mooncake's multi-buffer put never replaces an
entry), and sends the rest through `write`. `Writer.add_from` writes only keys that no client
holds or is writing, through Mooncake's put sessions (the first client to start one for a
key wins; every other start answers ``-705``), from registered memory or staging alike: a
plain put cannot tell, as it answers 0 for a key that exists or is being written and writes
nothing. Every write asks the store for ``config.replica_num`` copies.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from mmkey._deadline import Done, Outcome, Why
from mmkey._tensors import byte_view, host_ready, nbytes_of
from mmkey.cache.mooncake import Added
from mmkey.cache.mooncake._reserved import (
    RESERVED_WAIT_S,
    Reservations,
    fill_sessions,
    namespaces_of,
    refused_as,
    reserved_or_held,
)
from mmkey.cache.mooncake._staging import Staging, _RegistrationRefused, aligned, registered, stage_entry
from mmkey.cache.mooncake._transport import (
    INVALID_PARAMS,
    RPC_FAILURES,
    CacheParts,
    Pending,
    StoreTransport,
)
from mmkey.entry.codec import encode_entry_into, entry_header, entry_size
from mmkey.errors import StoreError

if TYPE_CHECKING:
    import torch
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

__all__ = ["Writer"]

_PUT_CHUNK = 64 << 20
"""Payload bytes sealed and sent per multi-buffer put."""
_RESERVED_POLLS = 10
"""How many times a reserved key is looked at again within its wait."""


def _as_added(stored: dict[str, bool]) -> dict[str, Added]:
    """Upsert outcomes (stored or not) as `Added` outcomes."""
    return {text: Added.STORED if ok else Added.FAILED for text, ok in stored.items()}


def _as_stored(outcomes: dict[str, Added]) -> dict[str, bool]:
    """`Added` outcomes as whether each key was written by this call."""
    return {text: outcome is Added.STORED for text, outcome in outcomes.items()}


def _put_chunks(payloads: dict[str, list[torch.Tensor]]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """`payloads` in runs of at most `_PUT_CHUNK` bytes (or one payload)."""
    chunk: dict[str, list[torch.Tensor]] = {}
    total = 0
    for text, runs in payloads.items():
        size = sum(nbytes_of(t) for t in runs)
        if chunk and total + size > _PUT_CHUNK:
            yield chunk
            chunk, total = {}, 0
        chunk[text] = runs
        total += size
    if chunk:
        yield chunk


class _StagedWrite:
    """The entries of one `Writer.write` call, sealed into a lane's staging buffer and sent
    on the worker (`run`), in batches of what the buffer holds.

    The worker reads the caller's tensors only while holding `_reading`, and never after the
    caller stopped waiting (`release`): a caller that timed out may reuse its tensors at
    once, and a late encode would store that new data under old keys.
    """

    def __init__(
        self,
        writer: Writer,
        parts: CacheParts,
        texts: list[str],
        tensors: list[torch.Tensor],
        give_up: float,
        only_new: bool,
    ) -> None:
        keyring = parts.keyring
        self._writer = writer
        self._transport = parts.transport
        self._keyring = keyring
        self._texts = texts
        self._tensors = tensors
        self._sizes = [entry_size(text, t, keyring=keyring) for text, t in zip(texts, tensors, strict=True)]
        self._give_up = give_up
        self._only_new = only_new
        self._ready = host_ready(tensors)  # CUDA tensors: an event on the caller's current stream
        self._reading = threading.Lock()
        self._released = threading.Event()

    def run(self, store: MooncakeDistributedStore, lane_staging: Staging) -> dict[str, Added]:
        """On the worker: seal every entry and send them; what each key's write did."""
        self._ready.wait()  # the caller's kernels writing the tensors have finished
        lane_staging.view(store)  # prepared at set-up; this only checks
        transport = self._transport
        if not lane_staging.lease.acquire(timeout=transport.left(self._give_up)):
            raise TimeoutError("the staging buffer stayed busy past the call's deadline")
        try:
            stored: dict[str, Added] = {}
            batch: list[tuple[str, int, int]] = []  # key text, offset, size
            used = 0
            for text, t, size in zip(self._texts, self._tensors, self._sizes, strict=True):
                if size > lane_staging.nbytes:  # a registered buffer of its own
                    transport.out_of_time(self._give_up)
                    stored[text] = self._writer.write_large_on_worker(
                        store, text, t, size, self.encode, self._only_new
                    )
                    continue
                if used + size > lane_staging.nbytes:
                    transport.out_of_time(self._give_up)
                    stored.update(self._flush(store, lane_staging.ptr, batch))
                    batch, used = [], 0
                with self._reading:
                    self._check_waited_for()
                    stage_entry(lane_staging, used, size, text, t, self._keyring)
                batch.append((text, used, size))
                used += aligned(size)
            stored.update(self._flush(store, lane_staging.ptr, batch))
            return stored
        finally:
            lane_staging.lease.release()

    def encode(self, target: memoryview, text: str, tensor: torch.Tensor) -> None:
        """Seal one entry into `target` (while the caller still waits)."""
        with self._reading:
            self._check_waited_for()
            encode_entry_into(target, text, tensor, keyring=self._keyring)

    def release(self) -> None:
        """The caller stops waiting: no tensor of its is read after this returns."""
        # Flag first, then wait out the entry being staged right now, if any: a lane that
        # re-takes `_reading` entry after entry would otherwise keep a late caller waiting
        # (the lock is not fair), well past its deadline on a busy host.
        self._released.set()
        with self._reading:
            pass

    def _check_waited_for(self) -> None:
        if self._released.is_set():
            raise StoreError("insert_batch stopped waiting; its tensors are not read")

    def _flush(
        self, store: MooncakeDistributedStore, base: int, batch: list[tuple[str, int, int]]
    ) -> dict[str, Added]:
        if self._only_new:
            return self._writer.add_staged_on_worker(store, base, batch)
        return _as_added(self._writer.flush_on_worker(store, base, batch))


class Writer:
    """Runs the writes of one `MooncakeCache` over its transport.

    ``clock`` (by default the transport's) times the waits for reserved keys, ``sleep``
    pauses between looks at them."""

    def __init__(
        self,
        parts: CacheParts,
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        reserved_wait: float = RESERVED_WAIT_S,
    ) -> None:
        self._parts = parts
        self._transport: StoreTransport = parts.transport
        clock = parts.transport.clock if clock is None else clock
        self._clock = clock
        self._sleep = sleep
        self._reserved = Reservations(reserved_wait, clock)
        self._replicas: ReplicateConfig | None = None  # made on first write
        self._stuck: set[str] = set()
        """Keys of sessions this client could neither end nor revoke (Mooncake answers -601
        to both once another client upserted the key): its starts of them answer -600 until
        a revoke succeeds."""
        self._stuck_lock = threading.Lock()

    def write(
        self, texts: list[str], tensors: list[torch.Tensor], give_up: float, *, only_new: bool = False
    ) -> dict[str, Added]:
        """Write entries through the staging buffer on the worker, within one timeout: upserts,
        or with `only_new` put sessions that write only keys no client holds or is writing."""
        staged = _StagedWrite(self, self._parts, texts, tensors, give_up, only_new)
        try:
            if not self._may_write(give_up):
                return {}
            lane = self._transport.pick_lane(set())
            if lane is None:
                self._parts.skipped("every transfer lane stuck")
                return {}
            outcome = self._finish(self._transport.submit(lane, staged.run), give_up)
            return outcome.value if isinstance(outcome, Done) else {}
        finally:
            staged.release()

    def _may_write(self, give_up: float) -> bool:
        """Whether a write may go to the store now: the master answers (the breaker) and
        writes are not held off (`StoreTransport.write_breaker`: one trial per `retry_after`)."""
        if not self._transport.ready(give_up):
            return False
        if self._transport.write_breaker.allow():
            return True
        self._parts.skipped("writes held off: a write to the store timed out")
        return False

    def _finish(self, pending: Pending[dict[str, Added]], give_up: float) -> Outcome[dict[str, Added]]:
        """The outcome of a submitted write, told to the write breaker: a write that timed out
        with at least half the timeout to run opens it (its holder hangs, or the master does);
        one that stored an entry, in time or late, closes it."""
        short = self._transport.cut_short(give_up)
        outcome = self._transport.finish(pending, give_up, abandoned=self._landed)
        if isinstance(outcome, Done):
            self._landed(outcome.value)
        elif outcome.why is Why.TIMED_OUT and not short:
            self._transport.write_breaker.failure()
        return outcome

    def _landed(self, outcomes: dict[str, Added]) -> None:
        if any(outcome is Added.STORED for outcome in outcomes.values()):
            self._transport.write_breaker.success()

    def write_from(self, latest: dict[str, list[torch.Tensor]], give_up: float) -> dict[str, bool]:
        """Store payloads held in runs: straight from registered memory when the key is new,
        through staging otherwise (Mooncake's multi-buffer put never replaces an entry)."""
        direct: dict[str, list[torch.Tensor]] = {}
        staged: dict[str, list[torch.Tensor]] = {}
        for text, runs in latest.items():
            (direct if self._in_registered_memory(runs) else staged)[text] = runs
        stored: dict[str, bool] = {}
        if direct:
            texts = list(direct)
            transport = self._parts.transport

            def look(store: MooncakeDistributedStore) -> tuple[bool, list[int]]:
                return transport.register_regions(store), store.batch_is_exist(texts)

            looked = transport.meta(look, give_up)
            if not isinstance(looked, Done):
                return stored
            registered_now, codes = looked.value
            if not RPC_FAILURES.isdisjoint(codes):
                transport.fail()
                return stored
            for text, code in zip(texts, codes, strict=False):  # unanswered keys: not stored
                if code == 1 or not registered_now:
                    staged[text] = direct.pop(text)
            stored.update(_as_stored(self._put_direct(direct, give_up, only_new=False)))
        if staged:
            stored.update(_as_stored(self.write(list(staged), _joined(staged), give_up)))
        return stored

    def add_from(self, latest: dict[str, list[torch.Tensor]], give_up: float) -> dict[str, Added]:
        """Write payloads held in runs only under keys that no client holds or is writing
        (put sessions): straight from registered memory where every run lies in it, through
        staging otherwise. A key another client reserves but the store does not hold is
        written over once its wait is over (`Added.RESERVED` if the call ends first). A key
        left out of the answer was not written."""
        added = self._add_once(latest, give_up)
        reserved = {text: latest[text] for text, outcome in added.items() if outcome is Added.RESERVED}
        if reserved:
            added.update(self._settle_reserved(reserved, give_up))
        self._reserved.forget(text for text, outcome in added.items() if outcome is not Added.RESERVED)
        return added

    def _settle_reserved(self, payloads: dict[str, list[torch.Tensor]], give_up: float) -> dict[str, Added]:
        """Keys another client's put session reserves while the store does not hold them:
        looked at again until their wait is over (`Added.HELD` once the store holds one),
        then upserted (this writer signs its own bytes), counted as ``squatted`` and logged.
        The wait ends at half of what is left of the call (the rest is the upsert's); keys
        whose wait is not over by then stay `Added.RESERVED`."""
        outcome: dict[str, Added] = {}
        texts = list(payloads)
        due = self._reserved.due(texts)
        budget = self._transport.left(give_up) / 2
        stop = self._transport.clock() + budget
        step = self._reserved.wait / _RESERVED_POLLS
        if due - self._clock() > budget:
            return dict.fromkeys(texts, Added.RESERVED)
        while texts and (left := due - self._clock()) > 0:
            if self._transport.clock() >= stop:  # the looks took the time
                return {**outcome, **dict.fromkeys(texts, Added.RESERVED)}
            self._sleep(min(step, left))
            held = self._held(texts, give_up)
            if held is None:
                return {**outcome, **dict.fromkeys(texts, Added.FAILED)}
            outcome.update(dict.fromkeys(held, Added.HELD))
            texts = [text for text in texts if text not in held]
        if not texts:
            return outcome
        written = self.write(texts, _joined({text: payloads[text] for text in texts}), give_up)
        healed = [text for text in texts if written.get(text) is Added.STORED]
        outcome.update({text: written.get(text, Added.FAILED) for text in texts})
        if healed:
            self._parts.squatted(len(healed), namespaces_of(healed), self._reserved.wait)
        return outcome

    def _held(self, texts: list[str], give_up: float) -> set[str] | None:
        """Which of `texts` the store holds; None if the master did not answer."""
        looked = self._transport.meta(lambda store: store.batch_is_exist(texts), give_up)
        if not isinstance(looked, Done):
            return None
        codes = looked.value
        if not RPC_FAILURES.isdisjoint(codes):
            self._parts.transport.fail()
            return None
        return {text for text, code in zip(texts, codes, strict=False) if code == 1}

    def _add_once(self, latest: dict[str, list[torch.Tensor]], give_up: float) -> dict[str, Added]:
        """One put-if-absent of every payload (`add_from` without the reserved keys' wait)."""
        direct: dict[str, list[torch.Tensor]] = {}
        staged: dict[str, list[torch.Tensor]] = {}
        for text, runs in latest.items():
            (direct if self._in_registered_memory(runs) else staged)[text] = runs
        added: dict[str, Added] = {}
        if direct:
            transport = self._parts.transport
            registered_now = transport.meta(transport.register_regions, give_up)
            if not isinstance(registered_now, Done):
                return added
            if registered_now.value:
                added.update(self._put_direct(direct, give_up, only_new=True))
            else:
                staged.update(direct)
        if staged:
            added.update(self.write(list(staged), _joined(staged), give_up, only_new=True))
        return added

    def _in_registered_memory(self, runs: list[torch.Tensor]) -> bool:
        """Whether every non-empty run lies in memory registered with the store."""
        region_of = self._parts.transport.region_of
        return all(region_of(t.data_ptr(), nbytes_of(t)) is not None for t in runs if nbytes_of(t))

    def _put_direct(
        self, payloads: dict[str, list[torch.Tensor]], give_up: float, *, only_new: bool
    ) -> dict[str, Added]:
        """Multi-buffer puts (put sessions with `only_new`) of header (from a lane's staging)
        and payload runs (from the caller's registered memory), one chunk at a time: the
        caller's thread seals the next chunk while a lane moves the one before."""
        stored: dict[str, Added] = {}
        if not payloads or not self._may_write(give_up):
            return stored
        taken: set[int] = set()
        inflight: deque[Pending[dict[str, Added]]] = deque()

        def drain_one() -> None:
            pending = inflight.popleft()
            outcome = self._finish(pending, give_up)
            if isinstance(outcome, Done):
                stored.update(outcome.value)
                taken.discard(self._transport.lanes.index(pending.lane))

        for chunk in _put_chunks(payloads):
            if self._transport.clock() >= give_up:
                break
            headers = {
                text: entry_header(text, runs, keyring=self._parts.keyring) for text, runs in chunk.items()
            }
            while inflight:  # one put at a time: this chunk was sealed while the last moved
                drain_one()
            lane = self._parts.transport.pick_lane(taken)
            if lane is None:
                self._parts.skipped("every transfer lane stuck")
                break
            work = functools.partial(
                self._put_direct_on_worker,
                headers=headers,
                payloads=chunk,
                give_up=give_up,
                only_new=only_new,
            )
            inflight.append(self._parts.transport.submit(lane, work))
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
        only_new: bool,
    ) -> dict[str, Added]:
        staging = lane_staging.view(store)
        if not lane_staging.lease.acquire(timeout=self._transport.left(give_up)):
            raise TimeoutError("the staging buffer stayed busy past the call's deadline")
        try:
            self._transport.out_of_time(give_up)
            keys: list[str] = []
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            at = 0
            for text, head in headers.items():
                if at + len(head) > staging.nbytes:
                    break  # not written: reported as not stored
                staging[at : at + len(head)] = head
                runs = [t for t in payloads[text] if nbytes_of(t)]
                keys.append(text)
                ptrs.append([lane_staging.ptr + at, *(t.data_ptr() for t in runs)])
                sizes.append([len(head), *(nbytes_of(t) for t in runs)])
                at += aligned(len(head))
            if only_new:
                return self._add_on_worker(store, keys, ptrs, sizes)
            codes = self._placed(store.batch_put_from_multi_buffers, keys, ptrs, sizes)
            # strict=False: keys the binding's answer leaves out are not stored
            return _as_added({text: code == 0 for text, code in zip(keys, codes, strict=False)})
        finally:
            lane_staging.lease.release()

    def _placed(self, write: Callable[..., list[int]], *args: object) -> list[int]:
        """`write(*args)` (a batch write of the binding) with `config.replica_num` copies
        (Mooncake's default placement for one); `StoreError` if the master did not answer."""
        codes = self._with_replicas(write, *args)
        if not RPC_FAILURES.isdisjoint(codes):
            name = getattr(write, "__name__", "batch write")
            raise StoreError(f"{name}: master unreachable ({codes[0]})")
        return codes

    def _with_replicas(self, write: Callable[..., list[int]], *args: object) -> list[int]:
        """`write(*args)` with `config.replica_num` copies (Mooncake's default placement for one)."""
        return write(*args) if self._parts.config.replica_num == 1 else write(*args, self._replicate())

    def _add_on_worker(
        self, store: MooncakeDistributedStore, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> dict[str, Added]:
        """Write each entry (its buffers, joined) only if no client holds or is writing its
        key: a put session per key (Mooncake grants a key's start to one client; the others
        get ``-705``), the buffers sent into it, and its end, which makes it readable. A
        session whose bytes did not all land, or whose end failed, is revoked; `StoreError`
        (after the revokes) if the master did not answer."""
        totals = [sum(run) for run in sizes]
        starts = self._with_replicas(store.batch_put_session_start, keys, totals)
        starts = self._restart_stuck(store, keys, totals, starts)
        self._forget_stuck([key for key, code in zip(keys, starts, strict=False) if code == 0])
        outcome = {
            key: refused_as(code, key in self._stuck)
            for key, code in zip(keys, starts, strict=False)  # keys left unanswered: not written
            if code != 0
        }
        outcome.update(reserved_or_held(store, [key for key, o in outcome.items() if o is Added.RESERVED]))
        opened = [i for i, code in enumerate(starts[: len(keys)]) if code == 0]
        stuck: set[str] = set()
        try:
            ended = fill_sessions(
                store,
                [keys[i] for i in opened],
                [ptrs[i] for i in opened],
                [sizes[i] for i in opened],
                [totals[i] for i in opened],
                stuck,
            )
        finally:
            if stuck:
                with self._stuck_lock:
                    self._stuck.update(stuck)
        outcome.update({keys[i]: Added.STORED if keys[i] in ended else Added.FAILED for i in opened})
        if not RPC_FAILURES.isdisjoint(starts):
            raise StoreError(f"batch_put_session_start: master unreachable ({starts[0]})")
        return outcome

    def _forget_stuck(self, granted: list[str]) -> None:
        """Drop keys whose session start was granted: no session of this client holds them
        (a revoke that failed for a fault, not an upsert, leaves nothing open)."""
        if granted and self._stuck:
            with self._stuck_lock:
                self._stuck.difference_update(granted)

    def _restart_stuck(
        self, store: MooncakeDistributedStore, keys: list[str], totals: list[int], starts: list[int]
    ) -> list[int]:
        """`starts`, where a start refused for a session this client left stuck is tried
        again once that session's revoke succeeds (the upserted key was removed since)."""
        with self._stuck_lock:
            stuck = [
                i
                for i, code in enumerate(starts[: len(keys)])
                if code == INVALID_PARAMS and keys[i] in self._stuck
            ]
        if not stuck:
            return starts
        revoked = store.batch_put_session_revoke([keys[i] for i in stuck])
        freed = [i for i, code in zip(stuck, revoked, strict=False) if code == 0]
        with self._stuck_lock:
            self._stuck.difference_update(keys[i] for i in freed)
        if not freed:
            return starts
        again = self._with_replicas(
            store.batch_put_session_start, [keys[i] for i in freed], [totals[i] for i in freed]
        )
        starts = list(starts)
        for i, code in zip(freed, again, strict=False):
            starts[i] = code
        return starts

    def _replicate(self) -> ReplicateConfig:
        """Mooncake's per-write placement settings: `config.replica_num` copies."""
        if self._replicas is None:
            from mooncake.store import ReplicateConfig

            replicas = ReplicateConfig()
            replicas.replica_num = self._parts.config.replica_num
            self._replicas = replicas
        return self._replicas

    def flush_on_worker(
        self, store: MooncakeDistributedStore, base: int, batch: list[tuple[str, int, int]]
    ) -> dict[str, bool]:
        if not batch:
            return {}
        keys = [text for text, _, _ in batch]
        ptrs = [base + offset for _, offset, _ in batch]
        sizes = [size for _, _, size in batch]
        codes = self._placed(store.batch_upsert_from, keys, ptrs, sizes)
        # strict=False: keys the binding's answer leaves out are not stored
        return {text: code == 0 for text, code in zip(keys, codes, strict=False)}

    def add_staged_on_worker(
        self, store: MooncakeDistributedStore, base: int, batch: list[tuple[str, int, int]]
    ) -> dict[str, Added]:
        """`_add_on_worker` of entries sealed in staging at ``base``."""
        if not batch:
            return {}
        keys = [text for text, _, _ in batch]
        return self._add_on_worker(
            store, keys, [[base + at] for _, at, _ in batch], [[n] for _, _, n in batch]
        )

    def write_large_on_worker(
        self,
        store: MooncakeDistributedStore,
        text: str,
        tensor: torch.Tensor,
        size: int,
        encode: Callable[[memoryview, str, torch.Tensor], None],
        only_new: bool,
    ) -> Added:
        import torch

        buf = torch.empty(size, dtype=torch.uint8)
        encode(byte_view(buf, writable=True), text, tensor)
        try:
            with registered(store, buf) as ptr:
                if only_new:
                    return self._add_on_worker(store, [text], [[ptr]], [[size]]).get(text, Added.FAILED)
                if self._parts.config.replica_num == 1:
                    code = store.upsert_from(text, ptr, size)
                else:
                    code = store.upsert_from(text, ptr, size, self._replicate())
        except _RegistrationRefused:  # this client's memory: a failed write, counted, no store fault
            self._parts.counts.add(errors=1)
            return Added.FAILED
        if code in RPC_FAILURES:
            raise StoreError(f"upsert_from: master unreachable ({code})")
        return Added.STORED if code == 0 else Added.FAILED


def _joined(runs_of: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each payload's runs as one tensor (the runs themselves where there is one)."""
    import torch

    return [runs[0] if len(runs) == 1 else torch.cat(runs) for runs in runs_of.values()]
