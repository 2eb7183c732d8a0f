"""The fake Mooncake client's set-up and its whole-value calls (see `mmkey.testing.fake_mooncake`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, overload

from mmkey.testing._fake_master import (
    _MASTERS,
    _MASTERS_LOCK,
    _NOT_SET_UP,
    _SETUP_FAILED,
    INVALID_PARAMS,
    OK,
    RPC_FAIL,
    FakeMooncakeMaster,
    _as_bytes,
    _check_key,
    _replica_num,
    _Session,
)

if TYPE_CHECKING:
    import mooncake.store
    from mooncake.store import ReplicateConfig

    _StoreBase = mooncake.store.MooncakeDistributedStore
else:
    _StoreBase = object


class FakeClient(_StoreBase):
    """The fake store's set-up and its calls that move whole values (`FakeMooncakeStore` adds
    registered memory, transfers to and from it, and put sessions)."""

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
