"""The transport under `MooncakeCache`: set-up and close, lanes, timeouts, breaker, quarantine.

Every binding call runs on a worker thread (a `mmkey._deadline.Lane`) and the caller waits at
most until its call's give-up time, read from the cache's clock; each call answers one
`Outcome` (`Done` with the binding's answer, or `Failed` with why), its failures already
counted and fed to the breaker. Metadata calls (``batch_is_exist``, replica lookups, set-up) run on
their own lane; transfers run on a small pool of lanes, each with its own registered staging
buffer, so a transfer stuck on a hung holder never holds up a lookup or a transfer from
another holder. Every lane's staging buffer is allocated (faulted in) and registered at
set-up, within ``setup_timeout``, so no call pays for it. The binding serves overlapping
calls from several threads (measured; the fleet tests run them). The breaker is about the
master: it opens when a metadata call fails or times out. A transfer that fails or times
out quarantines the holder it went to instead. A write's holder is not known before it goes
(the master places it), so a write that times out opens the *write breaker* instead
(`write_breaker`): writes are then skipped, one trial `retry_after` later, until one lands or
the timed-out one completes late. A trial write or a probe of a quarantined holder that goes
to a hung holder keeps a client thread busy until the transfer's deadline, so each that fails
doubles the wait before the next, up to `RETRY_BACKOFF` times `retry_after`.

Mooncake's ``setup()`` and ``close()`` hold the GIL, so while they run every thread of the
process stops; neither is called unless the master has just answered a request on its RPC
port (`master_answers`), right before the call. A store that cannot be closed that way (the
master does not answer, or a lane is still stuck in a call when `close` gives up) is
abandoned: never closed, never freed, left to the process's exit, so that no thread ever
freezes behind it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import attrs

from mmkey._deadline import MONOTONIC, Breaker, Clock, Done, Failed, Lane, Outcome, Ticket, Why
from mmkey._log import Counters, RateLimitedLog
from mmkey.cache.mooncake._net import bound_stalled_transfers, master_answers, parse_host_port
from mmkey.cache.mooncake._quarantine import Quarantine
from mmkey.cache.mooncake._staging import ReadSlots, Staging
from mmkey.cache.mooncake.config import MooncakeConfig
from mmkey.errors import StoreClosed, StoreError, TransferFailed

if TYPE_CHECKING:
    import torch
    from mooncake.store import MooncakeDistributedStore

    from mmkey.entry.auth import EntryKeyring

__all__ = [
    "ALREADY_EXISTS",
    "BUFFER_TOO_SMALL",
    "INVALID_PARAMS",
    "LOG",
    "LOG_EVERY_S",
    "RETRY_BACKOFF",
    "RPC_FAILURES",
    "TRANSFER_FAILURES",
    "CacheParts",
    "Pending",
    "Region",
    "StoreTransport",
    "TransferFailed",
    "TransferLane",
    "close_abandoned",
]

LOG = logging.getLogger("mmkey.cache.mooncake")
LOG_EVERY_S = 10.0
"""The shortest time between two warnings of one kind."""

T = TypeVar("T")

MAX_STAGING = 256 << 20
"""Largest registered staging buffer; larger entries get a buffer of their own."""
TRANSFER_LANES = 3
"""Transfer lanes: enough to read from two holders at once while one lane is stuck."""
RETRY_BACKOFF = 16
"""The longest wait between two trial writes, or two probes of a quarantined holder, in units
of ``retry_after`` (each that fails doubles it): with the default second, a hung holder costs a
client thread's transfer deadline at most every 16 s after four failed trials in a row."""
_PING_S = 1.0
"""The longest a liveness probe waits for the master (less when the call's time is short)."""


RPC_FAILURES = frozenset({-900, -901})
"""Codes that mean the master did not answer (RPC_FAIL, RPC_TIMEOUT)."""
BUFFER_TOO_SMALL = -600
"""The code of a read whose entry is larger than the buffer it was given."""
INVALID_PARAMS = -600
"""Mooncake's INVALID_PARAMS: also a put session's start for a key this client has a session
open on (measured, mooncake 0.3.13)."""
ALREADY_EXISTS = -705
"""Mooncake's OBJECT_ALREADY_EXISTS: a put session's start for a key that the store holds or
that another client has a session open on (measured, mooncake 0.3.13)."""
TRANSFER_FAILURES = range(-899, -799)
"""Codes of a transfer that reached the master but not the holder (TRANSFER_FAIL, -800...)."""


def _abandon(*objects: object) -> None:
    """Keep `objects` alive for good: a store that is never closed nor destroyed (its
    destructor would close it holding the GIL), and the buffers registered with it."""
    import ctypes

    for obj in objects:
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


_ABANDONED: list[tuple[StoreTransport, MooncakeDistributedStore]] = []
_ABANDONED_LOCK = threading.Lock()


def close_abandoned(timeout: float = _PING_S) -> int:
    """Close the stores left open by `StoreTransport.close` whose lanes have all stopped
    and whose master answers now; returns how many were closed.

    Each close stops every thread of the process for 1-2 s (Mooncake's close holds the GIL),
    so this runs only when asked: at interpreter exit, and from test suites that paused a
    master and want the store closed before they stop it (an abandoned store whose master
    is gone holds the process's exit for tens of seconds while its threads reconnect).
    """
    with _ABANDONED_LOCK:
        entries = list(_ABANDONED)
    closed = 0
    for transport, store in entries:
        if not transport.join(0) or not transport.master_answers(timeout):
            continue
        with _ABANDONED_LOCK:
            if (transport, store) not in _ABANDONED:
                continue
            _ABANDONED.remove((transport, store))
        store.close()  # its buffers stay alive (abandoned with it): never unregistered
        closed += 1
    return closed


atexit.register(close_abandoned)


@attrs.define(eq=False)
class TransferLane:
    """A transfer lane: one worker thread and the staging buffer only it fills."""

    worker: Lane
    staging: Staging


@attrs.frozen(eq=False)
class Region:
    """Host memory of the caller's registered with the store (e.g. an embedding pool);
    holding the tensor keeps the memory mapped while a transfer may still touch it."""

    tensor: torch.Tensor
    start: int
    nbytes: int

    def holds(self, ptr: int, size: int) -> bool:
        """Whether ``[ptr, ptr + size)`` lies inside this region."""
        return self.start <= ptr and ptr + size <= self.start + self.nbytes


@attrs.frozen
class Pending(Generic[T]):
    """A transfer submitted to a lane; wait for it with `StoreTransport.finish`."""

    lane: TransferLane
    ticket: Ticket[T]


class StoreTransport:
    """One Mooncake store reached through lanes, within timeouts, behind a breaker.

    `meta` runs a metadata function of the store and answers its `Outcome`: `Failed` (the
    failure counted through `on_error`, or `on_skip` for a call answered without the store)
    when the master is unreachable, the breaker is open, the lane is stuck, the call's time
    ran out, or the cache closed. `submit` and `finish` do the same for transfers on the
    pool of transfer lanes. Every time (give-up times, stuck lanes, the breaker, the
    quarantine) is read from `clock`.
    """

    def __init__(
        self,
        config: MooncakeConfig,
        store_class: type[MooncakeDistributedStore],
        on_error: Callable[[], None],
        on_skip: Callable[[], None],
        clock: Clock = MONOTONIC,
    ) -> None:
        self._config = config
        self.store_class = store_class
        self.clock = clock
        self._on_error = on_error
        self._on_skip = on_skip
        self._host, self._port = parse_host_port(config.master_server_address)
        self._meta = Lane("mmkey-mooncake-meta", clock)
        staging_bytes = min(config.local_buffer_size, MAX_STAGING)
        slots = ReadSlots(staging_bytes)  # shared: what one lane learns of entry sizes, all use
        self.lanes = tuple(
            TransferLane(Lane(f"mmkey-mooncake-transfer-{i}", clock), Staging(staging_bytes, slots))
            for i in range(TRANSFER_LANES)
        )
        self._prober = Lane("mmkey-mooncake-probe", clock)
        self.breaker = Breaker(config.retry_after, clock)  # a trial is one cheap call to the master
        # a probe or a trial write to a hung holder keeps a client thread busy until the
        # transfer's deadline: each that fails doubles the wait before the next
        longest = config.retry_after * RETRY_BACKOFF
        self.quarantine = Quarantine(config.retry_after, clock, longest)
        self.write_breaker = Breaker(config.retry_after, clock, longest)
        """Open after a write timed out (a hung holder, or master): while open, writes are
        skipped, so no write queues on a holder that does not answer."""
        self._store: MooncakeDistributedStore | None = None  # set on the metadata lane only
        self._regions: list[Region] = []  # registered at set-up, and then as they come
        self._registered: set[int] = set()  # start addresses registered (metadata lane only)
        self._closed = False
        self._suspect = False  # a call failed: the master must answer before the next one
        self._lock = threading.Lock()

    def register_memory(self, tensor: torch.Tensor) -> Region:
        """Record `tensor`'s memory for transfers straight from and to it, and register it
        with the store: now (on the metadata lane, not waited for) if the store is set up,
        else when it is. Registered memory stays referenced until the store is closed."""
        region = Region(tensor, tensor.data_ptr(), tensor.numel() * tensor.element_size())
        with self._lock:
            for other in self._regions:
                if region.start < other.start + other.nbytes and other.start < region.start + region.nbytes:
                    raise ValueError("this memory overlaps memory already registered with the store")
            self._regions.append(region)
        self.background(self.register_regions)
        return region

    def region_of(self, ptr: int, size: int) -> Region | None:
        """The recorded region that holds ``[ptr, ptr + size)``, if any."""
        for region in self._regions:
            if region.holds(ptr, size):
                return region
        return None

    def register_regions(self, store: MooncakeDistributedStore) -> bool:
        """Register every recorded region not registered yet (run it on the metadata lane);
        whether all are registered now."""
        for region in list(self._regions):
            if region.start not in self._registered:
                if store.register_buffer(region.start, region.nbytes) != 0:
                    return False
                self._registered.add(region.start)
        return True

    def is_connected(self) -> bool:
        """Whether the store is set up and the last call to the master succeeded."""
        return self._store is not None and not self.breaker.is_open()

    def busy_lanes(self) -> int:
        """Lanes running a call for longer than the timeout (stuck in the binding)."""
        workers = [self._meta, *(lane.worker for lane in self.lanes)]
        return sum(worker.is_stuck(self._config.timeout) for worker in workers)

    def master_answers(self, timeout: float) -> bool:
        """Whether the master replies to a request on its RPC port within `timeout` s."""
        return master_answers(self._host, self._port, timeout)

    def out_of_time(self, give_up: float) -> None:
        """Raise `TimeoutError` once the clock reached `give_up` (on a lane, between steps)."""
        if self.clock() >= give_up:
            raise TimeoutError("the call's deadline passed; the rest is not transferred")

    def left(self, give_up: float) -> float:
        """Seconds of the clock until `give_up`, never below 0."""
        return max(give_up - self.clock(), 0.0)

    def connect(self, give_up: float) -> Outcome[None]:
        """Set the store up if the master answers; `Failed` (counted) if not by `give_up`.

        A set-up still running then finishes on the metadata lane; a later call finds it.
        """
        outcome = self._meta.run(functools.partial(self._setup_on_lane, give_up), give_up)
        if isinstance(outcome, Done):
            if outcome.value:
                return _CONNECTED
            outcome = Failed(Why.RAISED, StoreError("the store could not be set up"))
        self.fail()
        return outcome

    def ready(self, give_up: float) -> bool:
        """Whether a call may go to the store now (set up, breaker closed, master answering
        if the last call failed); counts a skip or an error when not."""
        if self._closed:
            return False
        if not self.breaker.allow():
            self._on_skip()
            return False
        if self._store is None:
            return isinstance(self.connect(give_up), Done)
        # up to a second of the call's own time: a master that answers at all is alive, and on
        # a busy host a live master's answer can take longer than a fifth of a second
        if self._suspect and not self.master_answers(min(give_up - self.clock(), _PING_S)):
            self.fail()
            return False
        return True

    def meta(self, fn: Callable[[MooncakeDistributedStore], T], give_up: float) -> Outcome[T]:
        """`fn(store)` on the metadata lane, waited for until `give_up` (a time of the clock).

        `Failed` is counted: store errors and timeouts of a call the lane had started also
        open the breaker; a call still queued behind other callers' lookups when `give_up`
        came is a skip (the master was not asked), other exceptions of `fn` are only counted.
        A call given less than half the timeout (a claim wait's poll) that runs out is an
        error but no fault of the master: the caller's own bound ended it, and on a busy host
        a live master can take longer than that.
        """
        short = self.cut_short(give_up)
        if self._meta.is_stuck(self._config.timeout):
            self._on_skip()
            return _STUCK
        if not self.ready(give_up):
            return _REFUSED
        outcome = self._meta.run(functools.partial(self._run, fn), give_up)
        if isinstance(outcome, Done):
            self.succeeded()
        elif outcome.why is Why.NOT_STARTED:  # queued behind other lookups: the master was not asked
            self._on_skip()
        elif isinstance(outcome.error, StoreClosed):  # the cache closed meanwhile: not a fault
            pass
        elif outcome.why is Why.TIMED_OUT and short:  # the caller's bound, not the master's fault
            self._on_error()
        elif outcome.why is Why.TIMED_OUT or isinstance(outcome.error, StoreError):
            self.fail()
        elif isinstance(outcome.error, Exception):  # not a store fault (e.g. MemoryError)
            self._on_error()
        return outcome

    def cut_short(self, give_up: float) -> bool:
        """Whether a call given until `give_up` has less than half the timeout: if it runs
        out, its caller's own bound ended it, which says nothing about the store."""
        return give_up - self.clock() < self._config.timeout / 2

    def pick_lane(self, taken: set[int]) -> TransferLane | None:
        """A transfer lane for one more transfer: an idle one first, else one whose call is
        still within its timeout (queue behind it); ``None`` when every lane is stuck."""
        free = [i for i in range(len(self.lanes)) if i not in taken]
        for i in free:
            if not self.lanes[i].worker.is_busy():
                taken.add(i)
                return self.lanes[i]
        for i in free:
            if not self.lanes[i].worker.is_stuck(self._config.timeout):
                taken.add(i)
                return self.lanes[i]
        return None

    def submit(self, lane: TransferLane, fn: Callable[[MooncakeDistributedStore, Staging], T]) -> Pending[T]:
        """Queue `fn(store, lane.staging)` on `lane`."""
        return Pending(lane, lane.worker.submit(functools.partial(self._run_with, fn, lane.staging)))

    def finish(
        self,
        pending: Pending[T],
        give_up: float,
        abandoned: Callable[[T], object] | None = None,
    ) -> Outcome[T]:
        """The outcome of a submitted transfer by `give_up`; a failure is counted (a timeout,
        `TransferFailed`, or another error; a closed store is not). An abandoned call's
        eventual value goes to `abandoned`. Master faults open the breaker here."""
        outcome = pending.lane.worker.wait(pending.ticket, give_up, abandoned)
        if isinstance(outcome, Done):
            self.succeeded()  # a transfer asks the master first: it answered
        elif isinstance(outcome.error, StoreClosed):  # the cache closed meanwhile: not a fault
            pass
        elif outcome.why is not Why.RAISED or isinstance(outcome.error, TransferFailed):
            self._on_error()
            self._suspect = True  # the master may be what hangs: ask it before the next call
        elif isinstance(outcome.error, StoreError):
            self.fail()
        elif isinstance(outcome.error, Exception):  # not a store fault (e.g. MemoryError)
            self._on_error()
        return outcome

    def background(self, fn: Callable[[MooncakeDistributedStore], object]) -> None:
        """Queue `fn(store)` on the metadata lane without waiting (ahead of later lookups);
        its failures are ignored."""
        if not self._closed:
            self._meta.submit(functools.partial(self._run, fn))

    def probe(self, fn: Callable[[MooncakeDistributedStore], bool], endpoint: str) -> None:
        """Run `fn` (does `endpoint` answer again?) on the probe lane, without waiting."""
        self._prober.submit(functools.partial(self._probe_on_lane, fn, endpoint))

    def succeeded(self) -> None:
        """A call to the master succeeded: close the breaker."""
        self.breaker.success()
        self._suspect = False

    def fail(self) -> None:
        """A call to the master failed: open the breaker; ask the master before the next call."""
        self.breaker.failure()
        self._suspect = True
        self._on_error()

    def close(self) -> None:
        """Close the store, waiting at most ``config.timeout``; callers waiting are released.

        The binding's close runs only when every lane has stopped and the master answers
        right before it; otherwise the store is abandoned.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        give_up = time.monotonic() + self._config.timeout  # joins threads: the wall's time
        workers = [self._meta, self._prober, *(lane.worker for lane in self.lanes)]
        for worker in workers:
            worker.close()
        stopped = all(worker.join(max(give_up - time.monotonic(), 0.0)) for worker in workers)
        store, self._store = self._store, None
        if store is None:
            return
        left = give_up - time.monotonic()
        if stopped and left > 0 and self.master_answers(min(left, _PING_S)):
            for lane in self.lanes:
                lane.staging.unregister(store)
            for start in self._registered:
                store.unregister_buffer(start)
            self._registered.clear()
            store.close()
        else:
            self._on_error()
            regions = tuple(region.tensor for region in self._regions)
            _abandon(store, *(lane.staging.detach() for lane in self.lanes), *regions)
            with _ABANDONED_LOCK:
                _ABANDONED.append((self, store))

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every lane's worker to exit (after `close`); whether all did."""
        give_up = time.monotonic() + timeout
        workers = [self._meta, self._prober, *(lane.worker for lane in self.lanes)]
        return all(worker.join(max(give_up - time.monotonic(), 0.0)) for worker in workers)

    # -- on the lanes -----------------------------------------------------------------------

    def _run(self, fn: Callable[[MooncakeDistributedStore], T]) -> T:
        store = self._store
        if store is None or self._closed:
            raise StoreClosed("store closed")
        return fn(store)

    def _probe_on_lane(self, fn: Callable[[MooncakeDistributedStore], bool], endpoint: str) -> None:
        healthy = False
        try:
            healthy = bool(self._run(fn))
        except Exception:  # a probe that failed: the holder stays quarantined
            healthy = False
        finally:
            self.quarantine.probed(endpoint, healthy=healthy)

    def _run_with(self, fn: Callable[[MooncakeDistributedStore, Staging], T], staging: Staging) -> T:
        store = self._store
        if store is None or self._closed:
            raise StoreClosed("store closed")
        return fn(store, staging)

    def _prepare_staging(self, store: MooncakeDistributedStore) -> bool:
        """Allocate (faulted in) and register every lane's staging buffer; whether all are."""
        try:
            for lane in self.lanes:
                lane.staging.prepare(store)
        except (StoreError, OSError, MemoryError, RuntimeError):
            return False
        return True

    def _setup_on_lane(self, give_up: float) -> bool:
        if self._closed:
            return False
        if self._store is not None:
            return True
        left = give_up - self.clock()
        if left <= 0 or not self.master_answers(min(left, _PING_S)):
            return False
        bound_stalled_transfers(self._config.timeout)
        store = self.store_class()
        if store.setup(*self._config.setup_args(), tenant_id=self._config.tenant_id) != 0:
            store.close()  # measured safe and quick on a store whose setup failed
            return False
        if not self.register_regions(store) or not self._prepare_staging(store):
            for lane in self.lanes:
                lane.staging.unregister(store)
            store.close()
            self._registered.clear()
            return False
        self._store = store
        return True


_CONNECTED: Outcome[None] = Done(None)
_STUCK = Failed.of(Why.NOT_STARTED, "the metadata lane is stuck in a call past the timeout")
_REFUSED = Failed.of(Why.NOT_STARTED, "the store is not ready (closed, breaker open, or master silent)")


def _skips_log() -> RateLimitedLog:
    return RateLimitedLog(
        LOG, logging.WARNING, "Mooncake calls answered as misses without the store: %s%s", period=LOG_EVERY_S
    )


def _squats_log() -> RateLimitedLog:
    return RateLimitedLog(
        LOG,
        logging.WARNING,
        "Mooncake put sessions of another client reserved keys the store did not hold: %s%s",
        period=LOG_EVERY_S,
    )


@attrs.frozen
class CacheParts:
    """What one `MooncakeCache` hands its reads, writes and claims: its transport,
    configuration, keyring and counters, and the rate-limited logs of calls answered without
    the store and of squatted keys written over."""

    transport: StoreTransport
    config: MooncakeConfig
    keyring: EntryKeyring | None
    counts: Counters
    _skips: RateLimitedLog = attrs.field(init=False, factory=_skips_log)
    _squats: RateLimitedLog = attrs.field(init=False, factory=_squats_log)

    def skipped(self, why: str) -> None:
        """Count (``skipped``) and log (rate-limited) a call answered without the store."""
        self.counts.add(skipped=1)
        self._skips.note(why)

    def squatted(self, count: int, namespaces: list[str], wait: float) -> None:
        """Count (``squatted``) and log (rate-limited) keys written over a reservation that
        outlived its wait."""
        self.counts.add(squatted=count)
        names = ", ".join(repr(name) for name in namespaces)
        self._squats(
            "squat",
            f"{count} key(s) of namespace {names} stayed reserved and unwritten for {wait:g} s "
            "(a client that starts put sessions and never writes them, or a writer that died "
            "mid-write); this cache upserted its own entries over them (counted in "
            "stats().squatted)",
        )
