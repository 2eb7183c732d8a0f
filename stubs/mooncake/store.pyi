# Stubs for the pybind11 module `mooncake.store` (mooncake-transfer-engine 0.3.13).
#
# Only what a cache uses, with return types measured against a real mooncake_master
# (tests/cache/mooncake/test_mooncake_contract.py re-checks them). Methods left out are listed, with reasons,
# in stubs/stubtest_allowlist.txt. Parameters the binding names `arg0` are positional-only.
#
# Traps the types cannot show (see the contract test and /work/shared/MOONCAKE.md):
# - put, is_exist, batch_is_exist, remove, put_batch, get_size, get_hostname, remove_all
#   crash the interpreter on a store that is not set up or already closed.
# - A value whose items are wider than one byte (a float32 array) stores item-count bytes;
#   hence values are typed as bytes, bytearray or memoryview, not any buffer.
# - get/get_batch return b"" both for a missing key and on error; get_batch([]) returns [b""].
# - The multi-buffer calls trust every (pointer, size) pair: a size past the end of the memory
#   behind its pointer is read or written anyway (a too-long size list corrupted the heap).
# - A read stuck on a hung holder writes into its buffers whenever the holder answers, also after
#   the caller stopped waiting (tests/cache/mooncake/test_mooncake_fleet.py): never reuse a buffer a pending
#   read targets.

from collections.abc import Sequence
from typing import Any, TypeAlias, overload

_Value: TypeAlias = bytes | bytearray | memoryview

class ReplicateConfig:
    """Replication settings of one put; the default is one replica, no pinning."""

    replica_num: int
    with_hard_pin: bool
    preferred_segment: str
    preferred_segments: list[str]
    prefer_alloc_in_same_node: bool
    def __init__(self) -> None: ...

class Descriptor:
    """Where one replica's bytes sit: the holder's transfer endpoint and its buffer."""

    @property
    def transport_endpoint(self) -> str:
        """``"host:port"`` of the holder's transfer engine (not its `get_hostname`)."""

    @property
    def buffer_address(self) -> int: ...
    @property
    def size(self) -> int: ...

class MemoryDescriptor:
    """A replica held in a holder's memory segment."""

    @property
    def buffer_descriptor(self) -> Descriptor: ...

class ReplicaDescriptor:
    """One replica of a stored value, as the master lists it (reads use the first listed)."""

    def is_memory_replica(self) -> bool: ...
    def get_memory_descriptor(self) -> MemoryDescriptor:
        """Raises for a replica that is not in memory (check `is_memory_replica` first)."""

class MooncakeDistributedStore:
    """Client of a Mooncake master; every call returns a status code or data, never raises."""

    def __init__(self) -> None: ...
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
    ) -> int:
        """0 on success. Blocks ~90 s when no master listens: probe its port first."""

    @overload
    def setup(self, config: dict[str, Any]) -> int:
        """Same keys as the positional form; unknown keys are ignored silently."""

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable (heartbeat-based: ~1 s late)."""

    def close(self) -> int:
        """0; safe to repeat and on a store never set up. Takes ~1-2 s."""

    def get_hostname(self) -> str:
        """``"host:port"`` of this client's transfer endpoint."""
    # -- single key ------------------------------------------------------------------
    def put(self, key: str, value: _Value, config: ReplicateConfig = ...) -> int:
        """0 ok (also when the key exists: it is NOT overwritten), negative error code."""

    def upsert(self, key: str, value: _Value, config: ReplicateConfig = ...) -> int:
        """0 ok, replacing an existing value; negative error code."""

    def get(self, key: str, /) -> bytes:
        """The value, or ``b""`` for a missing key and on any error."""

    def get_size(self, key: str, /) -> int:
        """Size in bytes, or a negative error code (-704 not found)."""

    def is_exist(self, key: str, /) -> int:
        """1 exists, 0 not, negative error code."""

    def remove(self, key: str, force: bool = False) -> int:
        """0, -704 not found, -706 under lease (10 s after a read) unless ``force``."""

    def remove_all(self, force: bool = False) -> int:
        """Number of objects removed, or a negative error code."""
    # -- replicas --------------------------------------------------------------------
    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The replicas the master lists for `key` (``[]`` if absent)."""

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """The replicas of each key; keys the master does not hold are left out."""
    # -- batches ---------------------------------------------------------------------
    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """One 1 / 0 / negative code per key."""

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        """One status code per key."""

    def get_batch(self, keys: list[str], /) -> list[bytes]:
        """One value or ``b""`` per key. De-duplicate keys first: duplicates read stale data."""

    def put_batch(self, keys: list[str], values: Sequence[_Value], config: ReplicateConfig = ...) -> int:
        """ONE code for the whole batch: one bad item fails all of it."""

    def upsert_batch(self, keys: list[str], values: Sequence[_Value], config: ReplicateConfig = ...) -> int:
        """ONE code for the whole batch."""
    # -- zero copy from registered buffers -------------------------------------------
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """0 ok; the memory must stay alive until `unregister_buffer`."""

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """0 ok, -600 if not registered."""

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig = ...) -> int:
        """0 ok (an existing key is not overwritten), negative error code."""

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig = ...) -> int:
        """0 ok, replacing an existing value; negative error code."""

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read, -600 if ``size`` is too small, -704 not found."""

    def batch_put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig = ...,
    ) -> list[int]:
        """One status code per key."""

    def batch_upsert_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig = ...,
    ) -> list[int]:
        """One status code per key."""

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """Bytes read or a negative code per key. De-duplicate keys first."""

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig = ...,
    ) -> list[int]:
        """One code per key; each value is its buffers joined in order (an existing key: 0, kept)."""

    def batch_put_session_start(
        self, keys: list[str], sizes: list[int], config: ReplicateConfig = ...
    ) -> list[int]:
        """Reserve keys for this client, nothing transferred: per key 0, -705 if the store holds
        it or another client's session does, -600 if this client's own session does (or size 0)."""

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_dst_offsets: list[list[int]],
    ) -> list[int]:
        """Into keys of this client's open sessions, each buffer at its offset: the bytes written
        per key, or a negative code (bytes not written keep whatever the holder's memory held)."""

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        """Make this client's session keys readable: 0 per key, or a negative code."""

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        """Drop this client's open session keys unwritten: 0 per key, or a negative code."""

    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Per key: its size when the sizes sum to it exactly (scattered in order), -600 if they
        sum to less, -800 if to more (no holder fault), -704 not found."""
