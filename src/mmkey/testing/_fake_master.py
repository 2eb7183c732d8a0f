"""The fake Mooncake master (see `mmkey.testing.fake_mooncake`): the objects, the holders'
segments, the put sessions' reservations, the faults, and the codes it answers with."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import attrs

from mmkey._deadline import MONOTONIC

if TYPE_CHECKING:
    import mooncake.store
    from mooncake.store import ReplicateConfig
    from typing_extensions import Self

    # the binding's classes type these fakes (mypy checks each override against the stub),
    # and are never imported at run time
    _StoreBase = mooncake.store.MooncakeDistributedStore
    _DescriptorBase = mooncake.store.Descriptor
    _MemoryDescriptorBase = mooncake.store.MemoryDescriptor
    _ReplicaDescriptorBase = mooncake.store.ReplicaDescriptor
    _ReplicateConfigBase = mooncake.store.ReplicateConfig
else:
    _StoreBase = _DescriptorBase = _MemoryDescriptorBase = _ReplicaDescriptorBase = object
    _ReplicateConfigBase = object

_P = TypeVar("_P")
_N = TypeVar("_N")

OK = 0
"""Success."""
NO_AVAILABLE_HANDLE = -200
"""No holder has room for the value (the real master may answer it while it evicts)."""
INVALID_PARAMS = -600
"""An empty key or value, a buffer too small or not registered, a value too large; a put
session call for a key this client has no session of (or, for a start, already has one)."""
ILLEGAL_CLIENT = -601
"""Ending or revoking a put session whose key another client has written (an upsert) meanwhile."""
INVALID_REPLICA = -702
"""A ranged put session write with no ranges for a key."""
REPLICA_IS_NOT_READY = -703
"""The key is reserved by an open put session: sized, read or removed before it ends."""
TRANSFER_FAIL = -800
"""The master answered but the holder did not (or a multi-buffer read's sizes sum to more)."""
NOT_FOUND = -704
"""No such object."""
OBJECT_ALREADY_EXISTS = -705
"""A put session's start for a key that is stored or that another session has reserved."""
HAS_LEASE = -706
"""The object was read or looked up within its lease; ``force=True`` removes it anyway."""
RPC_FAIL = -900
"""The master did not answer."""

_NOT_SET_UP = 1
"""`health_check` of a store not set up, or closed."""
_SETUP_FAILED = -1
"""What `setup` returns when no fake master listens at the address (the real binding returns
non-zero only after retrying for ~90 s)."""
UNWRITTEN_BYTE = 0xDB
"""What the bytes a put session leaves unwritten read as once it ends (the real store leaves
whatever its memory held: never count on zeros)."""
_MAGIC = 21
_REQUEST = struct.Struct("<BBBBIIII")
_REPLY = struct.Struct("<BBBBIII")

_MASTERS: dict[str, FakeMooncakeMaster] = {}
_MASTERS_LOCK = threading.Lock()


class FakeReplicateConfig(_ReplicateConfigBase):
    """Replication settings of one put, like ``mooncake.store.ReplicateConfig``."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False


class FakeDescriptor(_DescriptorBase):
    """Where one replica's bytes sit: its holder's transfer endpoint and its size."""

    def __init__(self, endpoint: str, size: int) -> None:
        self._endpoint = endpoint
        self._size = size

    @property
    def transport_endpoint(self) -> str:
        """``"host:port"`` of the holder."""
        return self._endpoint

    @property
    def buffer_address(self) -> int:
        """0: the fake holds values as Python bytes, not at an address."""
        return 0

    @property
    def size(self) -> int:
        """The value's size in bytes."""
        return self._size


class FakeMemoryDescriptor(_MemoryDescriptorBase):
    """A replica held in a holder's memory segment."""

    def __init__(self, descriptor: FakeDescriptor) -> None:
        self._descriptor = descriptor

    @property
    def buffer_descriptor(self) -> FakeDescriptor:
        """The holder's endpoint and the value's size."""
        return self._descriptor


class FakeReplicaDescriptor(_ReplicaDescriptorBase):
    """One replica of a stored value (every fake replica is in memory)."""

    def __init__(self, endpoint: str, size: int) -> None:
        self._memory = FakeMemoryDescriptor(FakeDescriptor(endpoint, size))

    def is_memory_replica(self) -> bool:
        """True."""
        return True

    def get_memory_descriptor(self) -> FakeMemoryDescriptor:
        """Where the replica sits."""
        return self._memory


@attrs.define
class _Object:
    value: bytes
    holders: list[str]
    lease_until: float = 0.0


@attrs.define
class _Reservation:
    """An open put session on the master: its client's token, its room, since when."""

    token: object
    size: int
    holders: list[str]
    started: float


@attrs.define
class _Session:
    """An open put session on its client: the bytes written so far, where its room is."""

    token: object
    data: bytearray
    holders: list[str]


@attrs.define
class _Fault:
    code: int
    times: int


class FakeMooncakeMaster:
    """The objects, holders and faults that `FakeMooncakeStore` clients set up against
    `address` share; thread-safe. Stop it with `close` (or use it as a context manager).

    ``lease_s`` is how long a read or lookup keeps an object from a plain `remove`
    (Mooncake's default lease: 10 s); ``put_start_discard_timeout_s`` how long a put session's
    reservation holds its key against a new start (Mooncake's ``put_start_discard_timeout_sec``,
    30 s by default). Both are told by ``clock`` (monotonic seconds; a test passes a clock it
    advances, so that a lease or a reservation runs out without a sleep); the delays of `delay`
    are real sleeps.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        lease_s: float = 10.0,
        put_start_discard_timeout_s: float = 30.0,
        clock: Callable[[], float] = MONOTONIC,
    ) -> None:
        self._lock = threading.RLock()
        self.clock = clock
        self.lease_s = lease_s
        self.put_start_discard_timeout_s = put_start_discard_timeout_s
        self._objects: dict[str, _Object] = {}
        self._reserved: dict[str, _Reservation] = {}  # keys of open put sessions
        self._segments: dict[str, int] = {}  # holder endpoint -> segment bytes
        self._faults: dict[str, _Fault] = {}
        self._delays: dict[str, float] = {}
        self._unreachable: set[str] = set()
        self._paused: dict[str, threading.Event] = {}
        self._alive = True
        self._next_port = 40000
        self.calls: Counter[str] = Counter()
        """Calls of every client, by method name (faulted ones included)."""
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.1)
        self.address: str = f"{host}:{self._listener.getsockname()[1]}"
        """``"host:port"`` to give clients as the master's address."""
        self._stopping = threading.Event()
        self._answering = threading.Thread(target=self._answer_pings, name="mmkey-fake-master", daemon=True)
        self._answering.start()
        with _MASTERS_LOCK:
            _MASTERS[self.address] = self

    # -- faults ----------------------------------------------------------------------------

    def fail_next(self, method: str, *, code: int = RPC_FAIL, times: int = 1) -> None:
        """The next ``times`` calls of ``method`` (any client) fail with ``code``: an int result is
        ``code``, a list one ``code`` per key, bytes ``b""``, replica lookups empty."""
        with self._lock:
            self._faults[method] = _Fault(code, times)

    def delay(self, method: str, seconds: float) -> None:
        """Every later call of ``method`` sleeps ``seconds`` first (0 ends it); ``"ping"``
        delays the master's answer to the liveness probe on its RPC port."""
        with self._lock:
            if seconds > 0:
                self._delays[method] = seconds
            else:
                self._delays.pop(method, None)

    def make_unreachable(self, endpoint: str, unreachable: bool = True) -> None:
        """Transfers from or to holder ``endpoint`` fail with `TRANSFER_FAIL` (False: they work
        again); the master keeps listing its objects."""
        with self._lock:
            if unreachable:
                self._unreachable.add(endpoint)
            else:
                self._unreachable.discard(endpoint)

    def pause_holder(self, endpoint: str) -> None:
        """Transfers from or to holder ``endpoint`` block until `resume_holder` (or `close`),
        and then complete: a late read still writes its buffers, as with a stopped holder."""
        with self._lock:
            self._paused.setdefault(endpoint, threading.Event())

    def resume_holder(self, endpoint: str) -> None:
        """Let the transfers that `pause_holder` blocked go on."""
        with self._lock:
            event = self._paused.pop(endpoint, None)
        if event is not None:
            event.set()

    def flip_byte(self, key: str, offset: int = -1) -> None:
        """Corrupt a stored value: flip every bit of the byte at ``offset`` of ``key``'s value
        (`KeyError` if absent)."""
        with self._lock:
            obj = self._objects[key]
            value = bytearray(obj.value)
            value[offset] ^= 0xFF
            obj.value = bytes(value)

    def kill(self) -> None:
        """Stop answering: every call fails with `RPC_FAIL`, pings go unanswered, and every
        object is lost (a restarted master knows none)."""
        with self._lock:
            self._alive = False
            self._objects.clear()
            self._reserved.clear()

    def restart(self) -> None:
        """Answer again, with no objects; clients set up before re-join on their own."""
        with self._lock:
            self._alive = True

    # -- what it holds ---------------------------------------------------------------------

    def holders(self) -> list[str]:
        """Endpoints of the clients that lend a segment, in the order they were set up."""
        with self._lock:
            return list(self._segments)

    def holders_of(self, key: str) -> list[str]:
        """Endpoints of the holders of ``key``'s replicas (``[]`` if absent)."""
        with self._lock:
            obj = self._objects.get(key)
            return [] if obj is None else list(obj.holders)

    def keys(self) -> list[str]:
        """Every stored key."""
        with self._lock:
            return list(self._objects)

    def reserved(self) -> list[str]:
        """The keys that open put sessions reserve (not readable until ended)."""
        with self._lock:
            return list(self._reserved)

    def value(self, key: str) -> bytes | None:
        """The stored value of ``key``, or None."""
        with self._lock:
            obj = self._objects.get(key)
            return None if obj is None else obj.value

    def close(self) -> None:
        """Stop the listener; blocked transfers are let go."""
        with _MASTERS_LOCK:
            if _MASTERS.get(self.address) is self:
                del _MASTERS[self.address]
        self._stopping.set()
        self._answering.join()
        self._listener.close()
        with self._lock:
            paused, self._paused = list(self._paused.values()), {}
        for event in paused:
            event.set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FakeMooncakeMaster({self.address!r}, {len(self._objects)} objects)"

    # -- for the clients -------------------------------------------------------------------

    def _answer_pings(self) -> None:
        """Reply to each coro_rpc request (the liveness probe) while alive."""
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    request = b""
                    while len(request) < _REQUEST.size:
                        chunk = conn.recv(_REQUEST.size - len(request))
                        if not chunk:
                            break
                        request += chunk
                    if len(request) == _REQUEST.size and self._alive:
                        with self._lock:
                            delay = self._delays.get("ping", 0.0)
                        if delay:
                            time.sleep(delay)
                        seq = _REQUEST.unpack(request)[4]
                        conn.sendall(_REPLY.pack(_MAGIC, 0, 0, 0, seq, 0, 0))
                except OSError:
                    pass

    def _enter(self, method: str, *, local: bool = False) -> int | None:
        """Count a call; sleep its delay; the code it fails with, if it does (a call to the
        master fails while it is dead; a `local` one does not ask the master)."""
        with self._lock:
            self.calls[method] += 1
            delay = self._delays.get(method, 0.0)
            fault = self._faults.get(method)
            if fault is not None:
                fault.times -= 1
                if fault.times <= 0:
                    del self._faults[method]
            alive = self._alive
        if delay:
            time.sleep(delay)
        if fault is not None:
            return fault.code
        return None if alive or local else RPC_FAIL

    def _join(self, segment: int) -> str:
        with self._lock:
            self._next_port += 1
            endpoint = f"127.0.0.1:{self._next_port}"
            if segment > 0:
                self._segments[endpoint] = segment
            return endpoint

    def _leave(self, endpoint: str) -> None:
        """A client closed: its segment and every object and reservation on it are gone (the
        reservations it made elsewhere stay, like those of a client that died)."""
        with self._lock:
            if self._segments.pop(endpoint, None) is None:
                return
            for key in [k for k, o in self._objects.items() if endpoint in o.holders]:
                del self._objects[key]
            for key in [k for k, r in self._reserved.items() if endpoint in r.holders]:
                del self._reserved[key]

    def _free(self, endpoint: str) -> int:
        used = sum(len(o.value) for o in self._objects.values() if endpoint in o.holders)
        used += sum(r.size for r in self._reserved.values() if endpoint in r.holders)
        return self._segments[endpoint] - used

    def _place(self, size: int, writer: str, replicas: int) -> list[str]:
        """The holders with room for ``size`` bytes, the writer's own first (``[]``: none)."""
        free = {e: self._free(e) for e in self._segments}
        order = sorted(free, key=lambda e: (e != writer, -free[e]))
        return [e for e in order if free[e] >= size][: max(replicas, 1)]

    def _claimable(self, key: str) -> _Reservation | None:
        """``key``'s open put session, after discarding one older than the discard timeout."""
        reservation = self._reserved.get(key)
        if reservation is not None and (
            self.clock() - reservation.started >= self.put_start_discard_timeout_s
        ):
            del self._reserved[key]
            return None
        return reservation

    def _store(self, key: str, value: bytes, writer: str, replicas: int, replace: bool) -> int:
        """Place `value` under ``key`` (kept if present and not `replace`; a key an open put
        session reserves is left to it, unless `replace`). A write placed on a paused holder
        waits until it resumes (and is placed again); on an unreachable one it fails with
        `TRANSFER_FAIL`; either way nothing changes before it lands."""
        while True:
            with self._lock:
                old = self._objects.get(key)
                reservation = self._claimable(key)
                if (old is not None or reservation is not None) and not replace:
                    return OK
                if old is not None:
                    del self._objects[key]
                if reservation is not None:
                    del self._reserved[key]
                chosen = self._place(len(value), writer, replicas)
                blocked = self._transfer_to(chosen) if chosen else NO_AVAILABLE_HANDLE
                if blocked is None:
                    self._objects[key] = _Object(value, chosen)
                    return OK
                if old is not None:
                    self._objects[key] = old
                if reservation is not None:
                    self._reserved[key] = reservation
                if isinstance(blocked, int):
                    return blocked
            blocked.wait()

    def _transfer_to(self, holders: Sequence[str]) -> threading.Event | int | None:
        """What a transfer to `holders` meets (the lock held): None (it goes), `TRANSFER_FAIL`
        (one is unreachable) or the event a paused one waits for."""
        if any(h in self._unreachable for h in holders):
            return TRANSFER_FAIL
        return next((self._paused[h] for h in holders if h in self._paused), None)

    def _await_holders(self, holders: Sequence[str]) -> bool:
        """Wait out paused `holders`; whether a transfer to them can land (none unreachable)."""
        while True:
            with self._lock:
                blocked = self._transfer_to(holders)
            if not isinstance(blocked, threading.Event):
                return blocked is None
            blocked.wait()

    def _reserve(self, key: str, size: int, writer: str, replicas: int, token: object) -> list[str] | int:
        """Open a put session of ``size`` bytes for ``key``: the holders of its room, or
        `OBJECT_ALREADY_EXISTS` (stored, or reserved) or `NO_AVAILABLE_HANDLE`."""
        with self._lock:
            if key in self._objects or self._claimable(key) is not None:
                return OBJECT_ALREADY_EXISTS
            chosen = self._place(size, writer, replicas)
            if not chosen:
                return NO_AVAILABLE_HANDLE
            self._reserved[key] = _Reservation(token, size, chosen, self.clock())
            return list(chosen)

    def _settle(self, key: str, token: object, value: bytes | None) -> int:
        """End (store `value`) or revoke (None) the put session ``token`` holds on ``key``:
        `ILLEGAL_CLIENT` if another client's session or object has the key, `NOT_FOUND` to an
        end when neither (its room was lost), `OK` to a revoke then."""
        with self._lock:
            reservation = self._reserved.get(key)
            if reservation is not None and reservation.token is token:
                del self._reserved[key]
                if value is not None:
                    self._objects[key] = _Object(value, reservation.holders)
                return OK
            if reservation is not None or key in self._objects:
                return ILLEGAL_CLIENT
            return OK if value is None else NOT_FOUND

    def _holds(self, holders: Sequence[str]) -> bool:
        """Whether every one of ``holders`` still lends its segment."""
        with self._lock:
            return all(h in self._segments for h in holders)

    def _missing(self, key: str) -> int:
        """The code for reading, sizing or removing a key that is not stored."""
        with self._lock:
            return REPLICA_IS_NOT_READY if key in self._reserved else NOT_FOUND

    def _read(self, key: str) -> bytes | int:
        """``key``'s value after waiting out a paused holder; a code if it cannot be read."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return NOT_FOUND
            obj.lease_until = self.clock() + self.lease_s
            holder = obj.holders[0]
            value = obj.value
        return value if self._await_holders([holder]) else TRANSFER_FAIL

    def _look(self, key: str) -> _Object | None:
        with self._lock:
            obj = self._objects.get(key)
            if obj is not None:
                obj.lease_until = self.clock() + self.lease_s
            return obj

    def _remove(self, key: str, force: bool) -> int:
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return self._missing(key)
            if not force and obj.lease_until > self.clock():
                return HAS_LEASE
            del self._objects[key]
            return OK

    def _replicas(self, key: str) -> list[mooncake.store.ReplicaDescriptor]:
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return []
            return [FakeReplicaDescriptor(e, len(obj.value)) for e in obj.holders]


def _check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"incompatible function arguments: key is {type(key).__name__}, not str")
    return key


def _as_bytes(value: bytes | bytearray | memoryview) -> bytes:
    """What the binding stores of a buffer: as many bytes as it has items (see the stub)."""
    view = memoryview(value)
    return bytes(view.cast("B")[: len(view)]) if view.ndim else b""


def _replica_num(config: ReplicateConfig | None) -> int:
    return 1 if config is None else int(config.replica_num)
