"""`FakeMooncakeStore`: the fake client with registered memory, transfers to and from it, and
put sessions (see `mmkey.testing.fake_mooncake`)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mmkey.testing._fake_client import FakeClient
from mmkey.testing._fake_master import (
    _N,
    _P,
    ILLEGAL_CLIENT,
    INVALID_PARAMS,
    INVALID_REPLICA,
    OK,
    RPC_FAIL,
    TRANSFER_FAIL,
    UNWRITTEN_BYTE,
    FakeMooncakeMaster,
    _check_key,
    _replica_num,
    _Session,
)

if TYPE_CHECKING:
    from mooncake.store import ReplicateConfig


class FakeMooncakeStore(FakeClient):
    """An in-process ``MooncakeDistributedStore``: set up against a `FakeMooncakeMaster`'s
    address, it answers like the binding does against a real master. Unlike the binding,
    calls on a store that is not set up return `RPC_FAIL` instead of crashing."""

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
        if not master._await_holders(session.holders):
            return TRANSFER_FAIL
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
