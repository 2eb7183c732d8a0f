"""An in-process stand-in for Mooncake (master, holders and the ``mooncake.store`` client) for
fast, deterministic logic tests; real-master tests stay the reference.

`FakeMooncakeMaster` holds the objects; `FakeMooncakeStore` is a drop-in for the binding's
``MooncakeDistributedStore`` (``stubs/mooncake/store.pyi``): set up against a fake master's
address, it answers every call of the stub with the return codes the real binding returns
(``tests/cache/mooncake/test_mooncake_contract.py`` runs the same assertions against both). The fake master
also answers the liveness request that `MooncakeCache` sends to a master's RPC port, on a
loopback listener, so a cache runs on it unchanged::

    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(master_server_address=master.address)
        with MooncakeCache(config, store_class=FakeMooncakeStore) as cache:
            master.fail_next("batch_is_exist", code=RPC_FAIL)
            ...

Faults are injected, never timed: `FakeMooncakeMaster.fail_next` (the next calls of a method
return a code), `~FakeMooncakeMaster.kill`/`~FakeMooncakeMaster.restart` (every call fails
with `RPC_FAIL`, the objects are lost),
`make_unreachable` (transfers from a holder fail with `TRANSFER_FAIL`), `pause_holder`
(transfers from a holder block until `resume_holder`, then land, like a holder that was
stopped), `flip_byte` (corrupt a stored value) and `delay` (a method sleeps first). `calls` counts
every call by method name.

Put sessions (``batch_put_session_start`` and the calls that follow it) work as measured on the
binding: a start reserves a key (and its room) for one client, which alone writes ranges into it
and ends it (readable) or revokes it; meanwhile the key is absent to reads, a plain put of it
answers 0 and writes nothing, and every other start answers `OBJECT_ALREADY_EXISTS`. A client
that closes keeps its reservations on the master until ``put_start_discard_timeout_s`` has
passed (the master's ``put_start_discard_timeout_sec``), when the next start of the key
discards them; `FakeMooncakeMaster.reserved` lists the keys reserved. Bytes a session leaves
unwritten read as `UNWRITTEN_BYTE` once it ends (the real segment leaves whatever its memory
held: zeros when fresh, a freed value's bytes when reused).

What is simplified: objects are placed on the writer's own segment if it has room, else on the
holder with the most free room (the real master places at random); a full store answers
`NO_AVAILABLE_HANDLE` instead of evicting; calls to a dead master fail at once (the real one
takes seconds); transfers go only to and from memory registered with the fake store
(`INVALID_PARAMS` otherwise, where the real binding trusts every pointer).
"""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

import attrs

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

__all__ = [
    "HAS_LEASE",
    "ILLEGAL_CLIENT",
    "INVALID_PARAMS",
    "INVALID_REPLICA",
    "NOT_FOUND",
    "NO_AVAILABLE_HANDLE",
    "OBJECT_ALREADY_EXISTS",
    "OK",
    "REPLICA_IS_NOT_READY",
    "RPC_FAIL",
    "TRANSFER_FAIL",
    "UNWRITTEN_BYTE",
    "FakeDescriptor",
    "FakeMemoryDescriptor",
    "FakeMooncakeMaster",
    "FakeMooncakeStore",
    "FakeReplicaDescriptor",
    "FakeReplicateConfig",
]

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
    30 s by default).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        lease_s: float = 10.0,
        put_start_discard_timeout_s: float = 30.0,
    ) -> None:
        self._lock = threading.RLock()
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
        """Transfers from holder ``endpoint`` fail with `TRANSFER_FAIL` (False: they work again);
        the master keeps listing its objects."""
        with self._lock:
            if unreachable:
                self._unreachable.add(endpoint)
            else:
                self._unreachable.discard(endpoint)

    def pause_holder(self, endpoint: str) -> None:
        """Transfers from holder ``endpoint`` block until `resume_holder` (or `close`), and then
        complete: a late read still writes its buffers, as with a stopped holder."""
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
            time.monotonic() - reservation.started >= self.put_start_discard_timeout_s
        ):
            del self._reserved[key]
            return None
        return reservation

    def _store(self, key: str, value: bytes, writer: str, replicas: int, replace: bool) -> int:
        """Place `value` under ``key`` (kept if present and not `replace`; a key an open put
        session reserves is left to it, unless `replace`)."""
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
            if not chosen:
                if old is not None:
                    self._objects[key] = old
                if reservation is not None:
                    self._reserved[key] = reservation
                return NO_AVAILABLE_HANDLE
            self._objects[key] = _Object(value, chosen)
            return OK

    def _reserve(self, key: str, size: int, writer: str, replicas: int, token: object) -> list[str] | int:
        """Open a put session of ``size`` bytes for ``key``: the holders of its room, or
        `OBJECT_ALREADY_EXISTS` (stored, or reserved) or `NO_AVAILABLE_HANDLE`."""
        with self._lock:
            if key in self._objects or self._claimable(key) is not None:
                return OBJECT_ALREADY_EXISTS
            chosen = self._place(size, writer, replicas)
            if not chosen:
                return NO_AVAILABLE_HANDLE
            self._reserved[key] = _Reservation(token, size, chosen, time.monotonic())
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
            obj.lease_until = time.monotonic() + self.lease_s
            holder = obj.holders[0]
            value = obj.value
            unreachable = holder in self._unreachable
            paused = self._paused.get(holder)
        if paused is not None:
            paused.wait()
        return TRANSFER_FAIL if unreachable else value

    def _look(self, key: str) -> _Object | None:
        with self._lock:
            obj = self._objects.get(key)
            if obj is not None:
                obj.lease_until = time.monotonic() + self.lease_s
            return obj

    def _remove(self, key: str, force: bool) -> int:
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return self._missing(key)
            if not force and obj.lease_until > time.monotonic():
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


class FakeMooncakeStore(_StoreBase):
    """An in-process ``MooncakeDistributedStore``: set up against a `FakeMooncakeMaster`'s
    address, it answers like the binding does against a real master. Unlike the binding,
    calls on a store that is not set up return `RPC_FAIL` instead of crashing."""

    def __init__(self) -> None:
        self._master: FakeMooncakeMaster | None = None
        self._endpoint = ""
        self._local_buffer_size = 0
        self._buffers: dict[int, int] = {}  # registered start -> size
        self._sessions: dict[str, _Session] = {}  # this client's open put sessions
        self._lock = threading.Lock()

    @overload
    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        engine: object | None = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
    ) -> int: ...

    @overload
    def setup(self, config: dict[str, Any]) -> int: ...

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Join the fake master at ``master_server_addr``; 0, or non-zero when none listens
        there. A segment (``global_segment_size`` > 0) makes this client a holder."""
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            options: dict[str, Any] = dict(args[0])
        else:
            names = (
                "local_hostname",
                "metadata_server",
                "global_segment_size",
                "local_buffer_size",
                "protocol",
                "rdma_devices",
                "master_server_addr",
            )
            # the arguments given by position fill the first parameters, the rest keep defaults
            options = dict(zip(names, args, strict=False))
            options.update(kwargs)
        with _MASTERS_LOCK:
            master = _MASTERS.get(str(options.get("master_server_addr", "")))
        if master is None or not master._alive:
            return _SETUP_FAILED
        master._enter("setup")
        if self._master is not None:  # a second set-up drops the old segment, like the binding's
            self._master._leave(self._endpoint)
        self._endpoint = master._join(int(options.get("global_segment_size", 0)))
        self._local_buffer_size = int(options.get("local_buffer_size", 0))
        self._master = master
        return OK

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master dead."""
        if self._master is None:
            return _NOT_SET_UP
        return OK if self._master._alive else 2

    def close(self) -> int:
        """0; leaves the master (this client's objects are lost); safe to repeat."""
        master, self._master = self._master, None
        with self._lock:
            self._sessions.clear()  # their reservations stay on the master (see the module)
        if master is not None:
            master._leave(self._endpoint)
        return OK

    def get_hostname(self) -> str:
        """This client's endpoint, as replica descriptors list it."""
        return self._endpoint

    # -- single key ------------------------------------------------------------------------

    @staticmethod
    def _same_lengths(keys: Sequence[str], *per_key: Sequence[object]) -> bool:
        """Whether every per-key list has one item per key (the binding refuses the whole
        batch, `INVALID_PARAMS` for every key, when one does not)."""
        return all(len(items) == len(keys) for items in per_key)

    def _call(self, method: str) -> FakeMooncakeMaster | int:
        """The master to answer a call of `method`, or the code the call fails with."""
        master = self._master
        if master is None:
            return RPC_FAIL
        fault = master._enter(method)
        return master if fault is None else fault

    def _write(
        self,
        method: str,
        key: str,
        value: bytes,
        config: ReplicateConfig | None,
        replace: bool,
    ) -> int:
        master = self._call(method)
        if isinstance(master, int):
            return master
        if not key or not value:
            return INVALID_PARAMS
        return master._store(key, value, self._endpoint, _replica_num(config), replace)

    def put(
        self, key: str, value: bytes | bytearray | memoryview, config: ReplicateConfig | None = None
    ) -> int:
        """0 (an existing key keeps its value), or a negative code."""
        data = _as_bytes(value)
        if len(data) > self._local_buffer_size:
            return INVALID_PARAMS
        return self._write("put", _check_key(key), data, config, replace=False)

    def upsert(
        self, key: str, value: bytes | bytearray | memoryview, config: ReplicateConfig | None = None
    ) -> int:
        """0 (replacing an existing value), or a negative code."""
        data = _as_bytes(value)
        if len(data) > self._local_buffer_size:
            return INVALID_PARAMS
        return self._write("upsert", _check_key(key), data, config, replace=True)

    def get(self, key: str, /) -> bytes:
        """The value, or ``b""``."""
        master = self._call("get")
        if isinstance(master, int):
            return b""
        got = master._read(_check_key(key))
        return got if isinstance(got, bytes) else b""

    def get_size(self, key: str, /) -> int:
        """The value's size, or a negative code."""
        master = self._call("get_size")
        if isinstance(master, int):
            return master
        obj = master._look(_check_key(key))
        return master._missing(key) if obj is None else len(obj.value)

    def is_exist(self, key: str, /) -> int:
        """1, 0, or a negative code."""
        master = self._call("is_exist")
        if isinstance(master, int):
            return master
        return int(master._look(_check_key(key)) is not None)

    def remove(self, key: str, force: bool = False) -> int:
        """0, `NOT_FOUND`, or `HAS_LEASE` unless ``force``."""
        master = self._call("remove")
        if isinstance(master, int):
            return master
        return master._remove(_check_key(key), force)

    def remove_all(self, force: bool = False) -> int:
        """How many objects were removed, or a negative code."""
        master = self._call("remove_all")
        if isinstance(master, int):
            return master
        stored = master.keys()  # a snapshot: _remove deletes from the master's table
        return sum(master._remove(k, force) == OK for k in stored)

    # -- replicas --------------------------------------------------------------------------

    def get_replica_desc(self, key: str) -> list[mooncake.store.ReplicaDescriptor]:
        """Where ``key``'s replicas sit (``[]`` if absent or on a fault)."""
        master = self._call("get_replica_desc")
        if isinstance(master, int):
            return []
        return master._replicas(_check_key(key))

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[mooncake.store.ReplicaDescriptor]]:
        """Where each held key's replicas sit; absent keys are left out (all on a fault)."""
        master = self._call("batch_get_replica_desc")
        if isinstance(master, int):
            return {}
        found = {_check_key(k): master._replicas(k) for k in keys}
        return {k: v for k, v in found.items() if v}

    # -- batches ---------------------------------------------------------------------------

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1 / 0 / a negative code per key."""
        master = self._call("batch_is_exist")
        if isinstance(master, int):
            return [master] * len(keys)
        return [int(master._look(_check_key(k)) is not None) for k in keys]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        """A code per key."""
        master = self._call("batch_remove")
        if isinstance(master, int):
            return [master] * len(keys)
        return [master._remove(_check_key(k), force) for k in keys]

    def get_batch(self, keys: list[str], /) -> list[bytes]:
        """A value or ``b""`` per key; ``[b""]`` for no keys, like the binding."""
        if not keys:
            return [b""]
        master = self._call("get_batch")
        if isinstance(master, int):
            return [b""] * len(keys)
        read = [master._read(_check_key(k)) for k in keys]
        return [v if isinstance(v, bytes) else b"" for v in read]

    def _write_batch(
        self,
        method: str,
        keys: list[str],
        values: Sequence[bytes | bytearray | memoryview],
        config: ReplicateConfig | None,
        replace: bool,
    ) -> int:
        master = self._call(method)
        if isinstance(master, int):
            return master
        data = [_as_bytes(v) for v in values]
        if len(data) != len(keys) or any(
            not _check_key(k) or not d or len(d) > self._local_buffer_size
            for k, d in zip(keys, data, strict=True)
        ):
            return INVALID_PARAMS  # one bad item fails the batch, nothing stored
        for key, value in zip(keys, data, strict=True):
            rc = master._store(key, value, self._endpoint, _replica_num(config), replace)
            if rc != OK:
                return rc
        return OK

    def put_batch(
        self,
        keys: list[str],
        values: Sequence[bytes | bytearray | memoryview],
        config: ReplicateConfig | None = None,
    ) -> int:
        """One code for the batch."""
        return self._write_batch("put_batch", keys, values, config, replace=False)

    def upsert_batch(
        self,
        keys: list[str],
        values: Sequence[bytes | bytearray | memoryview],
        config: ReplicateConfig | None = None,
    ) -> int:
        """One code for the batch."""
        return self._write_batch("upsert_batch", keys, values, config, replace=True)

    # -- zero copy from registered buffers -------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """0; transfers may then use ``[buffer_ptr, buffer_ptr + size)``."""
        master = self._master
        if master is not None and (fault := master._enter("register_buffer", local=True)):
            return fault
        with self._lock:
            self._buffers[buffer_ptr] = size
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """0, or `INVALID_PARAMS` if not registered."""
        master = self._master
        if master is not None and (fault := master._enter("unregister_buffer", local=True)):
            return fault
        with self._lock:
            return OK if self._buffers.pop(buffer_ptr, None) is not None else INVALID_PARAMS

    def _registered(self, ptr: int, size: int) -> bool:
        with self._lock:
            return any(s <= ptr and ptr + size <= s + n for s, n in self._buffers.items())

    def _load(self, ptrs: Sequence[int], sizes: Sequence[int]) -> bytes | None:
        """The bytes at the (pointer, size) spans, joined; None if one is not registered."""
        if len(ptrs) != len(sizes) or not all(
            self._registered(p, n) for p, n in zip(ptrs, sizes, strict=True)
        ):
            return None
        return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True))

    def _scatter(self, key: str, ptrs: Sequence[int], sizes: Sequence[int]) -> int:
        """Read ``key`` into the spans: its size, or a code (nothing written on one)."""
        master = self._master
        if master is None:
            return RPC_FAIL
        if len(ptrs) != len(sizes) or not all(
            self._registered(p, n) for p, n in zip(ptrs, sizes, strict=True)
        ):
            return INVALID_PARAMS
        obj = master._look(_check_key(key))
        if obj is None:
            return master._missing(key)
        total = sum(sizes)
        if total < len(obj.value):
            return INVALID_PARAMS
        if total > len(obj.value):
            return TRANSFER_FAIL
        value = master._read(key)
        if isinstance(value, int):
            return value
        if len(value) != total:  # replaced while the holder was paused
            return TRANSFER_FAIL
        at = 0
        for ptr, size in zip(ptrs, sizes, strict=True):
            ctypes.memmove(ptr, value[at : at + size], size)
            at += size
        return total

    def _put_spans(
        self,
        key: str,
        ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None,
        replace: bool,
    ) -> int:
        master = self._master
        if master is None:
            return RPC_FAIL
        data = self._load(ptrs, sizes)
        if data is None or not _check_key(key) or not data:
            return INVALID_PARAMS
        return master._store(key, data, self._endpoint, _replica_num(config), replace)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """0 (an existing key keeps its value), or a negative code."""
        master = self._call("put_from")
        if isinstance(master, int):
            return master
        return self._put_spans(key, [buffer_ptr], [size], config, False)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """0 (replacing an existing value), or a negative code."""
        master = self._call("upsert_from")
        if isinstance(master, int):
            return master
        return self._put_spans(key, [buffer_ptr], [size], config, True)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read, `INVALID_PARAMS` if ``size`` is too small, `NOT_FOUND`."""
        master = self._call("get_into")
        if isinstance(master, int):
            return master
        return self._read_into(key, buffer_ptr, size)

    def _read_into(self, key: str, ptr: int, size: int, *, write: bool = True) -> int:
        master = self._master
        if master is None:
            return RPC_FAIL
        obj = master._look(_check_key(key))
        if obj is None:
            return master._missing(key)
        length = len(obj.value)
        if length > size or not self._registered(ptr, length):
            return INVALID_PARAMS
        return self._scatter(key, [ptr], [length]) if write else length

    def _per_key(
        self,
        method: str,
        keys: list[str],
        ptrs: list[_P],
        sizes: list[_N],
        each: Callable[[int, str, _P, _N], int],
    ) -> list[int]:
        """A code per key of a batch call: the master's fault for every key, `INVALID_PARAMS`
        for every key when the lists differ in length (as the binding), else ``each``'s."""
        master = self._call(method)
        if isinstance(master, int):
            return [master] * len(keys)
        if not self._same_lengths(keys, ptrs, sizes):
            return [INVALID_PARAMS] * len(keys)
        return [each(i, k, p, n) for i, (k, p, n) in enumerate(zip(keys, ptrs, sizes, strict=True))]

    def batch_put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """A code per key (existing keys keep their values)."""
        return self._per_key(
            "batch_put_from",
            keys,
            buffer_ptrs,
            sizes,
            lambda _, k, p, n: self._put_spans(k, [p], [n], config, False),
        )

    def batch_upsert_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """A code per key."""
        return self._per_key(
            "batch_upsert_from",
            keys,
            buffer_ptrs,
            sizes,
            lambda _, k, p, n: self._put_spans(k, [p], [n], config, True),
        )

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """Bytes read or a negative code per key. A key given twice is read into its last
        buffer only; its earlier buffers are left as they were, reported as read (measured)."""
        last = {k: i for i, k in enumerate(keys)}
        return self._per_key(
            "batch_get_into",
            keys,
            buffer_ptrs,
            sizes,
            lambda i, k, p, n: self._read_into(k, p, n, write=last[k] == i),
        )

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """A code per key; each value is its buffers joined (an existing key keeps its value)."""
        return self._per_key(
            "batch_put_from_multi_buffers",
            keys,
            all_buffer_ptrs,
            all_sizes,
            lambda _, k, p, n: self._put_spans(k, p, n, config, False),
        )

    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Per key: its size when the sizes sum to it, `INVALID_PARAMS` if to less,
        `TRANSFER_FAIL` if to more, `NOT_FOUND`."""
        return self._per_key(
            "batch_get_into_multi_buffers",
            keys,
            all_buffer_ptrs,
            all_sizes,
            lambda _, k, p, n: self._scatter(k, p, n),
        )

    # -- put sessions ----------------------------------------------------------------------

    def batch_put_session_start(
        self, keys: list[str], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        """Reserve each key for this client: 0, `OBJECT_ALREADY_EXISTS` if stored or another
        session reserves it, `INVALID_PARAMS` if this client's session already does (before
        this call: a key twice in one call gets `OBJECT_ALREADY_EXISTS` the second time) or
        for size 0, `NO_AVAILABLE_HANDLE` if no holder has room."""
        keys = [_check_key(k) for k in keys]
        master = self._call("batch_put_session_start")
        if isinstance(master, int):
            return [master] * len(keys)
        if not self._same_lengths(keys, sizes):
            return [INVALID_PARAMS] * len(keys)
        with self._lock:
            open_before = set(self._sessions)
        codes: list[int] = []
        for key, size in zip(keys, sizes, strict=True):
            if not key or size <= 0 or key in open_before:
                codes.append(INVALID_PARAMS)
                continue
            token = object()
            placed = master._reserve(key, size, self._endpoint, _replica_num(config), token)
            if isinstance(placed, int):
                codes.append(placed)
                continue
            with self._lock:
                self._sessions[key] = _Session(token, bytearray([UNWRITTEN_BYTE]) * size, placed)
            codes.append(OK)
        return codes

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_dst_offsets: list[list[int]],
    ) -> list[int]:
        """Write each key's buffers at their offsets into this client's session of it: the
        bytes written, or `INVALID_PARAMS` (no such session, a range past its size, lists
        of different lengths), `INVALID_REPLICA` for no ranges."""
        keys = [_check_key(k) for k in keys]
        master = self._call("batch_put_from_multi_buffer_ranges")
        if isinstance(master, int):
            return [master] * len(keys)
        if not self._same_lengths(keys, all_buffer_ptrs, all_sizes, all_dst_offsets):
            return [INVALID_PARAMS] * len(keys)
        return [
            self._write_ranges(master, k, p, n, o)
            for k, p, n, o in zip(keys, all_buffer_ptrs, all_sizes, all_dst_offsets, strict=True)
        ]

    def _write_ranges(
        self,
        master: FakeMooncakeMaster,
        key: str,
        ptrs: Sequence[int],
        sizes: Sequence[int],
        offsets: Sequence[int],
    ) -> int:
        with self._lock:
            session = self._sessions.get(key)
        if session is None or not len(ptrs) == len(sizes) == len(offsets):
            return INVALID_PARAMS
        if not ptrs:
            return INVALID_REPLICA
        room = len(session.data)
        if any(o < 0 or n < 0 or o + n > room for o, n in zip(offsets, sizes, strict=True)):
            return INVALID_PARAMS
        data = self._load(ptrs, sizes)
        if data is None or not master._holds(session.holders):  # its room left with its holder
            return INVALID_PARAMS
        at = 0
        for offset, size in zip(offsets, sizes, strict=True):
            session.data[offset : offset + size] = data[at : at + size]
            at += size
        return at

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        """Make each of this client's session keys readable: 0, `INVALID_PARAMS` (no such
        session), `ILLEGAL_CLIENT` (another client wrote the key: the session stays open),
        `NOT_FOUND` (its room was lost)."""
        return self._settle_sessions("batch_put_session_end", keys, end=True)

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        """Drop each of this client's session keys unwritten: 0, `INVALID_PARAMS` (no such
        session), `ILLEGAL_CLIENT` (another client wrote the key: nothing removed, the
        session stays open)."""
        return self._settle_sessions("batch_put_session_revoke", keys, end=False)

    def _settle_sessions(self, method: str, keys: list[str], *, end: bool) -> list[int]:
        keys = [_check_key(k) for k in keys]
        master = self._call(method)
        if isinstance(master, int):
            return [master] * len(keys)
        codes: list[int] = []
        for key in keys:
            with self._lock:
                session = self._sessions.get(key)
            if session is None:
                codes.append(INVALID_PARAMS)
                continue
            code = master._settle(key, session.token, bytes(session.data) if end else None)
            if code != ILLEGAL_CLIENT:
                with self._lock:
                    if self._sessions.get(key) is session:
                        del self._sessions[key]
            codes.append(code)
        return codes

    def __repr__(self) -> str:
        state = "not set up" if self._master is None else f"at {self._endpoint}"
        return f"FakeMooncakeStore({state})"
