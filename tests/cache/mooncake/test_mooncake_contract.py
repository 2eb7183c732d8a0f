"""Contract of stubs/mooncake/store.pyi: the real binding returns what the stub says, and so
does the fake (`mmkey.testing.fake_mooncake`): every test runs against both.

The real binding runs against a real local master, the fake against a `FakeMooncakeMaster`.
Every store here is set up successfully before any call other than ``health_check``/``close``
(the binding crashes the interpreter otherwise).

Multi-buffer (scatter/gather) transfers, measured on 0.3.13.post1:

- ``batch_put_from_multi_buffers`` stores the concatenation of a key's buffers, in order; on an
  existing key it returns 0 and keeps the old value, like ``put``.
- ``batch_get_into_multi_buffers`` scatters an entry over the buffers when their sizes sum to
  exactly the entry's size, whatever the split, and returns that size. Sizes summing to less give
  -600 (buffer too small), to more -800 (TRANSFER_FAIL, while the holder is healthy: a reader must
  check its sizes before taking -800 from a multi-buffer read for a holder fault); a missing key
  -704. Each key of a batch gets its own code.
- The binding trusts every (pointer, size) pair: a size larger than the memory behind its pointer
  is written past it (measured: "free(): invalid next size"). These tests hand it only spans inside
  a buffer they own (`Arena.spans`).
- A read stuck on a paused holder writes its buffers when the holder resumes, also after the caller
  stopped waiting (``tests/cache/mooncake/test_mooncake_fleet.py``).

Put sessions (put-if-absent), measured on 0.3.13.post1:

- ``batch_put_session_start`` answers per key: 0, the key reserved for this client; -705
  (OBJECT_ALREADY_EXISTS) if the store holds it or another client's session reserves it (of clients
  racing for a key exactly one gets 0); -600 if this client's own session already reserves it (only
  sessions opened before the call: a key twice in one call gets 0, then -705), for size 0 or an
  empty key, and for every key when the lists differ in length; -200 if no holder has room (the
  reservation takes its room at once: a later put that no longer fits gets -200).
- While the session is open the key is absent: ``is_exist`` 0, ``get`` b"", replicas ``[]``;
  ``get_size``, ``get_into``, the batch reads and ``remove`` (also forced) answer -703
  (REPLICA_IS_NOT_READY); a plain ``put`` (any put: from buffers, batches) answers 0 and writes
  nothing; ``remove_all`` leaves it.
- ``batch_put_from_multi_buffer_ranges`` writes each buffer at its offset within the reserved
  object and answers the bytes written per key; later writes overwrite earlier ones. -600 for a key
  without this client's session (or another client's), a range past the reserved size, per-key
  lists of different lengths; -702 (INVALID_REPLICA) for no ranges; a zero-size range writes 0.
- ``batch_put_session_end`` answers 0 and the value is readable; the bytes no write reached hold
  whatever the holder's memory held: zeros when fresh, the bytes of a freed value when reused
  (never count on zeros). ``batch_put_session_revoke`` answers 0 and the key is absent again.
  After either, this client's end or revoke of the key answers -600 (as for a key never started).
- An ``upsert`` during the session stores its value (``is_exist`` 1); the session's own writes still
  answer their sizes, but its end answers -601 (ILLEGAL_CLIENT) and its revoke -601, neither removes
  the upserted value, and the session stays open on the client (its new start answers -600) until a
  revoke succeeds, which it does once the key is gone.
- A client that closes does not revoke its sessions: the key stays reserved (-705 to others) until
  the master's ``put_start_discard_timeout_sec`` (30 s; not tested here). A session whose room sat
  on a holder that left: its writes answer -600, its end -704.
"""

from __future__ import annotations

import array
import ast
import ctypes
import inspect
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore, FakeReplicateConfig
from mmkey.testing.mooncake_master import master_unavailable_reason
from mmkey.testing.pytest_plugin import REQUIRE_ENV
from tests._clock import FakeClock
from tests._support import wait_until

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

MiB = 1 << 20
OK = 0
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
ILLEGAL_CLIENT = -601
INVALID_REPLICA = -702
REPLICA_IS_NOT_READY = -703
NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
HAS_LEASE = -706
TRANSFER_FAIL = -800
STUB = Path(__file__).resolve().parents[3] / "stubs" / "mooncake" / "store.pyi"


class Master(Protocol):
    """What these tests do with a master: the real `MasterProcess` or a `FakeMooncakeMaster`."""

    @property
    def address(self) -> str: ...
    def kill(self) -> None: ...
    def restart(self) -> None: ...


@attrs.frozen
class Binding:
    """The client classes under test: the real binding's, or the fake's."""

    name: str
    store_class: type[MooncakeDistributedStore]
    replicate_config: type[ReplicateConfig]


def _real_binding() -> Binding:
    unavailable = master_unavailable_reason()
    if unavailable is not None:
        if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
            pytest.fail(f"{REQUIRE_ENV} is set but {unavailable}", pytrace=False)
        pytest.skip(unavailable)
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    return Binding("real", MooncakeDistributedStore, ReplicateConfig)


@pytest.fixture(scope="module", params=[pytest.param("real", marks=pytest.mark.mooncake), "fake"])
def binding(request: pytest.FixtureRequest) -> Binding:
    """Each test runs once against the real binding and once against the fake."""
    if request.param == "real":
        return _real_binding()
    return Binding("fake", FakeMooncakeStore, FakeReplicateConfig)


@pytest.fixture(scope="module")
def session_master(binding: Binding, request: pytest.FixtureRequest) -> Iterator[Master]:
    """A master shared by the module's tests: leave it running."""
    if binding.name == "real":
        yield request.getfixturevalue("mooncake_master_session")
        return
    with FakeMooncakeMaster() as master:
        yield master


@pytest.fixture
def fresh_master(binding: Binding, request: pytest.FixtureRequest) -> Iterator[Master]:
    """A fresh master for one test (kill and restart it freely)."""
    if binding.name == "real":
        yield request.getfixturevalue("mooncake_master")
        return
    with FakeMooncakeMaster() as master:
        yield master


def _setup(binding: Binding, address: str, segment: int = 64 * MiB) -> MooncakeDistributedStore:
    store = binding.store_class()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 64 * MiB, "tcp", "", address)
    assert type(rc) is int
    if rc != OK:
        store.close()
        pytest.fail(f"setup against {address} returned {rc}")
    return store


@pytest.fixture(scope="module")
def store(binding: Binding, session_master: Master) -> Iterator[MooncakeDistributedStore]:
    s = _setup(binding, session_master.address)
    yield s
    assert s.close() == OK


@pytest.fixture
def key() -> str:
    """A key prefix no other test uses."""
    return f"contract-{uuid.uuid4().hex}"


def _int_list(value: object) -> list[int]:
    assert type(value) is list
    assert all(type(item) is int for item in value)
    return value


def test_session_basics(store: MooncakeDistributedStore) -> None:
    health = store.health_check()
    assert type(health) is int
    assert health == OK
    hostname = store.get_hostname()
    assert type(hostname) is str
    assert hostname.startswith("127.0.0.1:")


def test_put_get_upsert(store: MooncakeDistributedStore, key: str) -> None:
    rc = store.put(key, b"first")
    assert type(rc) is int
    assert rc == OK
    value = store.get(key)
    assert type(value) is bytes
    assert value == b"first"
    assert store.put(key, b"second") == OK  # reports success ...
    assert store.get(key) == b"first"  # ... but does not overwrite
    assert store.upsert(key, b"third") == OK
    assert store.get(key) == b"third"
    missing = store.get(key + "-missing")
    assert type(missing) is bytes
    assert missing == b""


def test_value_types_of_the_stub(store: MooncakeDistributedStore, key: str) -> None:
    assert store.put(key + "-ba", bytearray(b"abc")) == OK
    assert store.put(key + "-mv", memoryview(b"abcd")) == OK
    assert store.get(key + "-ba") == b"abc"
    assert store.get(key + "-mv") == b"abcd"
    assert store.put(key + "-empty", b"") == INVALID_PARAMS  # empty values cannot be stored


def test_wide_item_buffers_store_item_counts(store: MooncakeDistributedStore, key: str) -> None:
    """Why the stub takes bytes, bytearray or memoryview and not any buffer."""
    floats = array.array("f", [1.0] * 10)
    assert store.put(key, floats) == OK  # type: ignore[arg-type]
    assert len(store.get(key)) == 10  # not 40: the value is silently truncated


def test_exists_and_size(store: MooncakeDistributedStore, key: str) -> None:
    assert store.put(key, b"12345") == OK
    present, absent = store.is_exist(key), store.is_exist(key + "-missing")
    assert (type(present), type(absent)) == (int, int)
    assert (present, absent) == (1, 0)
    assert _int_list(store.batch_is_exist([key, key + "-missing"])) == [1, 0]
    assert _int_list(store.batch_is_exist([])) == []
    size = store.get_size(key)
    assert type(size) is int
    assert size == 5
    assert store.get_size(key + "-missing") == NOT_FOUND


def test_remove_codes(store: MooncakeDistributedStore, key: str) -> None:
    assert store.put(key, b"v") == OK
    assert store.get(key) == b"v"  # a read takes a lease of about 10 s
    rc = store.remove(key)
    assert type(rc) is int
    assert rc == HAS_LEASE
    assert store.remove(key, force=True) == OK
    assert store.remove(key) == NOT_FOUND
    assert store.get(key) == b""
    assert store.put(key + "-a", b"a") == OK
    assert _int_list(store.batch_remove([key + "-a", key + "-b"], force=True)) == [OK, NOT_FOUND]


def test_batches(store: MooncakeDistributedStore, key: str) -> None:
    keys = [key + "-1", key + "-2"]
    rc = store.put_batch(keys, [b"one", bytearray(b"two")])
    assert type(rc) is int
    assert rc == OK
    values = store.get_batch([*keys, key + "-missing"])
    assert type(values) is list
    assert all(type(v) is bytes for v in values)
    assert values == [b"one", b"two", b""]
    assert store.upsert_batch(keys, (b"ONE", memoryview(b"TWO"))) == OK
    assert store.get_batch(keys) == [b"ONE", b"TWO"]
    assert store.put_batch([key + "-3", key + "-4"], [b"x", b""]) == INVALID_PARAMS
    assert store.get_batch([key + "-3", key + "-4"]) == [b"", b""]  # one bad item fails all
    assert store.put_batch([], []) == OK
    assert store.get_batch([]) == [b""]  # not []: callers must not send an empty batch


def test_replicate_config(store: MooncakeDistributedStore, binding: Binding, key: str) -> None:
    config = binding.replicate_config()
    assert type(config.replica_num) is int
    assert config.replica_num == 1
    assert type(config.with_hard_pin) is bool
    assert type(config.preferred_segment) is str
    assert type(config.preferred_segments) is list
    assert type(config.prefer_alloc_in_same_node) is bool
    config.replica_num = 1
    assert store.put(key, b"v", config) == OK
    assert store.upsert(key, b"w", config=config) == OK
    assert store.put_batch([key + "-b"], [b"v"], config) == OK
    assert store.get_batch([key, key + "-b"]) == [b"w", b"v"]


def test_keyword_names_of_the_stub(store: MooncakeDistributedStore, binding: Binding, key: str) -> None:
    assert store.put(key=key, value=b"v", config=binding.replicate_config()) == OK
    assert store.upsert(key=key, value=b"w") == OK
    assert store.batch_is_exist(keys=[key]) == [1]
    assert store.put_batch(keys=[key + "-b"], values=[b"v"]) == OK
    assert store.upsert_batch(keys=[key + "-b"], values=[b"w"]) == OK
    assert store.remove(key=key + "-b", force=True) == OK
    assert store.batch_remove(keys=[key], force=True) == [OK]


def test_positional_only_parameters(store: MooncakeDistributedStore, key: str) -> None:
    with pytest.raises(TypeError):
        store.get(key=key)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        store.is_exist(key=key)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        store.get_size(key=key)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        store.get_batch(keys=[key])  # type: ignore[call-arg]


def test_int_keys_are_rejected(store: MooncakeDistributedStore) -> None:
    with pytest.raises(TypeError):
        store.put(12345, b"v")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.batch_is_exist([12345])  # type: ignore[list-item]


def test_zero_copy(store: MooncakeDistributedStore, key: str) -> None:
    size = 1 * MiB
    buffer = bytearray(size)
    view = (ctypes.c_char * size).from_buffer(buffer)  # pins the memory while registered
    base = ctypes.addressof(view)
    rc = store.register_buffer(base, size)
    assert type(rc) is int
    assert rc == OK
    try:
        buffer[0:5] = b"HELLO"
        assert store.put_from(key, base, 5) == OK
        read = store.get_into(key, base + 1000, 1000)
        assert type(read) is int
        assert read == 5
        assert buffer[1000:1005] == b"HELLO"
        assert store.get_into(key, base + 2000, 2) == INVALID_PARAMS  # buffer too small
        assert store.get_into(key + "-missing", base + 2000, 100) == NOT_FOUND
        assert store.upsert_from(key=key, buffer_ptr=base + 1, size=4) == OK
        assert store.get(key) == b"ELLO"

        keys = [key + "-1", key + "-2"]
        assert _int_list(store.batch_put_from(keys, [base, base + 1], [5, 4])) == [OK, OK]
        got = store.batch_get_into(
            [*keys, key + "-missing"], [base + 3000, base + 4000, base + 5000], [64, 64, 64]
        )
        assert _int_list(got) == [5, 4, NOT_FOUND]
        assert buffer[3000:3005] == b"HELLO"
        assert buffer[4000:4004] == b"ELLO"
        assert _int_list(store.batch_upsert_from(keys[:1], [base + 2], [3])) == [OK]
        assert store.get(keys[0]) == b"LLO"
    finally:
        rc = store.unregister_buffer(base)
    assert type(rc) is int
    assert rc == OK
    assert store.unregister_buffer(base) == INVALID_PARAMS  # not registered any more
    del view


def test_setup_forms_and_close(binding: Binding, fresh_master: Master) -> None:
    address = fresh_master.address
    fresh = binding.store_class()
    assert fresh.health_check() == 1  # not set up: the only calls allowed are these two
    assert fresh.close() == OK

    by_keyword = binding.store_class()
    rc = by_keyword.setup(
        local_hostname="127.0.0.1",
        metadata_server="P2PHANDSHAKE",
        global_segment_size=16 * MiB,
        local_buffer_size=16 * MiB,
        protocol="tcp",
        rdma_devices="",
        master_server_addr=address,
    )
    assert rc == OK
    by_dict = binding.store_class()
    config = {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 16 * MiB,
        "local_buffer_size": 16 * MiB,
        "protocol": "tcp",
        "master_server_addr": address,
        "no_such_key": 1,  # ignored silently
    }
    assert by_dict.setup(config) == OK
    try:
        assert by_keyword.health_check() == OK
        assert by_dict.put("dict-form", b"v") == OK
        assert by_keyword.get("dict-form") == b"v"
        removed = by_keyword.remove_all(force=True)
        assert type(removed) is int
        assert removed >= 1
    finally:
        started = time.monotonic()
        closed = by_keyword.close()
        close_seconds = time.monotonic() - started
        assert by_dict.close() == OK
    assert type(closed) is int
    assert closed == OK
    assert close_seconds < 10.0
    assert by_keyword.health_check() == 1  # closed
    assert by_keyword.close() == OK  # closing twice is fine


def test_master_restart_loses_keys_and_client_recovers(binding: Binding, fresh_master: Master) -> None:
    s = _setup(binding, fresh_master.address)
    try:
        assert s.put("survivor", b"v") == OK
        fresh_master.kill()
        fresh_master.restart()
        # the client re-joined the restarted master on its own
        assert wait_until(lambda: s.put("after-restart", b"w") == OK, 20.0, poll=0.2)
        assert s.get("after-restart") == b"w"
        assert s.get("survivor") == b""  # a restarted master has lost every key
    finally:
        assert s.close() == OK


class Arena:
    """A registered buffer of this process; hands the binding only (pointer, size) spans inside it."""

    def __init__(self, store: MooncakeDistributedStore, size: int) -> None:
        self.store = store
        self.buffer = bytearray(size)
        self._view = (ctypes.c_char * size).from_buffer(self.buffer)  # pins the memory
        self.base = ctypes.addressof(self._view)
        assert store.register_buffer(self.base, size) == OK

    def spans(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Pointers to ``offsets``, after checking that every span lies inside the buffer."""
        assert len(offsets) == len(sizes)
        for offset, size in zip(offsets, sizes, strict=True):
            assert offset >= 0 and size > 0 and offset + size <= len(self.buffer), (offset, size)
        return [self.base + offset for offset in offsets]

    def fill(self, offset: int, data: bytes) -> None:
        self.buffer[offset : offset + len(data)] = data

    def read(self, offset: int, size: int) -> bytes:
        return bytes(self.buffer[offset : offset + size])

    def close(self) -> None:
        assert self.store.unregister_buffer(self.base) == OK
        del self._view


@pytest.fixture(scope="module")
def arena(store: MooncakeDistributedStore) -> Iterator[Arena]:
    a = Arena(store, 1 * MiB)
    yield a
    a.close()


ENTRY = bytes((i * 7 + 3) % 251 for i in range(3 * 4096 + 123))
"""A multi-page entry whose bytes differ page to page (a misplaced piece cannot go unnoticed)."""
SENTINEL = 0xA5


def _layout(sizes: Sequence[int], start: int, gap: int = 64) -> list[int]:
    """Offsets placing pieces of ``sizes`` one after another from ``start``, ``gap`` bytes apart."""
    offsets, at = [], start
    for size in sizes:
        offsets.append(at)
        at += size + gap
    return offsets


def _scatter_read(
    store: MooncakeDistributedStore, arena: Arena, key: str, sizes: Sequence[int], start: int
) -> tuple[int, list[int]]:
    """Read ``key`` into pieces of ``sizes`` laid out from ``start``, over sentinel bytes that
    also cover the 64 bytes before and after every piece."""
    offsets = _layout(sizes, start)
    end = offsets[-1] + sizes[-1] + 64
    arena.fill(start - 64, bytes([SENTINEL]) * (end - start + 64))
    (rc,) = _int_list(store.batch_get_into_multi_buffers([key], [arena.spans(offsets, sizes)], [list(sizes)]))
    return rc, offsets


def test_multi_buffer_put_stores_the_concatenation(
    store: MooncakeDistributedStore, arena: Arena, key: str
) -> None:
    pieces = [(0, 100), (8192, 5000), (20000, 7)]
    arena.fill(0, ENTRY[:100])
    arena.fill(8192, ENTRY[100:5100])
    arena.fill(20000, b"-tail--")
    offsets, sizes = [o for o, _ in pieces], [n for _, n in pieces]
    rc = store.batch_put_from_multi_buffers([key], [arena.spans(offsets, sizes)], [sizes])
    assert _int_list(rc) == [OK]
    joined = ENTRY[:100] + ENTRY[100:5100] + b"-tail--"
    assert store.get(key) == joined
    assert store.get_size(key) == sum(sizes) == 5107
    # a batch: one code per key, each key its own buffers
    two = [key + "-a", key + "-b"]
    rc = store.batch_put_from_multi_buffers(
        two, [arena.spans([0], [10]), arena.spans([8192, 0], [20, 30])], [[10], [20, 30]]
    )
    assert _int_list(rc) == [OK, OK]
    assert store.get_batch(two) == [ENTRY[:10], ENTRY[100:120] + ENTRY[:30]]
    assert _int_list(store.batch_put_from_multi_buffers([], [], [])) == []


def _splits() -> st.SearchStrategy[list[int]]:
    """Every way to cut ``ENTRY`` into 1 to 8 non-empty pieces."""
    cuts = st.sets(st.integers(1, len(ENTRY) - 1), max_size=7)
    return cuts.map(lambda c: [b - a for a, b in zip([0, *sorted(c)], [*sorted(c), len(ENTRY)], strict=True)])


@given(sizes=_splits())
@example(sizes=[64, 4096, len(ENTRY) - 64 - 4096])
@example(sizes=[len(ENTRY)])
@example(sizes=[1, len(ENTRY) - 2, 1])
@example(sizes=[4096, 4096, 4096, 123])
def test_multi_buffer_get_scatters_an_exact_split(
    store: MooncakeDistributedStore, arena: Arena, sizes: list[int]
) -> None:
    key = "contract-scatter-entry"
    assert store.upsert(key, ENTRY) == OK
    rc, offsets = _scatter_read(store, arena, key, sizes, start=64 * 1024)
    assert rc == len(ENTRY)
    assert b"".join(arena.read(o, n) for o, n in zip(offsets, sizes, strict=True)) == ENTRY
    around = [arena.read(offsets[0] - 64, 64)] + [
        arena.read(o + n, 64) for o, n in zip(offsets, sizes, strict=True)
    ]
    assert all(g == bytes([SENTINEL]) * 64 for g in around)  # nothing written outside the pieces


def test_multi_buffer_get_codes(store: MooncakeDistributedStore, arena: Arena, key: str) -> None:
    assert store.put(key, ENTRY) == OK
    total = len(ENTRY)
    short, _ = _scatter_read(store, arena, key, [100, total - 101], start=128 * 1024)
    assert short == INVALID_PARAMS  # sizes sum to one byte less than the entry
    long, _ = _scatter_read(store, arena, key, [100, total - 99], start=128 * 1024)
    assert long == TRANSFER_FAIL  # one byte more: a transfer failure, with nothing wrong in the store
    assert _scatter_read(store, arena, key, [4096, 4 * 4096], start=128 * 1024)[0] == TRANSFER_FAIL
    assert store.health_check() == OK
    assert store.get(key) == ENTRY  # the holder serves the entry as before
    assert _scatter_read(store, arena, key, [total], start=128 * 1024)[0] == total
    missing, _ = _scatter_read(store, arena, key + "-missing", [total], start=128 * 1024)
    assert missing == NOT_FOUND
    # each key of a batch gets its own code (distinct keys: duplicates in one batch read misread)
    assert store.put(key + "-b", ENTRY) == OK
    keys = [key, key + "-b", key + "-missing"]
    sizes = [[total - 1], [total + 1], [10]]
    ptrs = [arena.spans([o], n) for o, n in zip([160 * 1024, 192 * 1024, 224 * 1024], sizes, strict=True)]
    got = store.batch_get_into_multi_buffers(keys, ptrs, sizes)
    assert _int_list(got) == [INVALID_PARAMS, TRANSFER_FAIL, NOT_FOUND]
    sizes = [[total], [total - 1], [total]]
    got = store.batch_get_into_multi_buffers(keys, ptrs, sizes)
    assert _int_list(got) == [total, INVALID_PARAMS, NOT_FOUND]
    assert arena.read(160 * 1024, total) == ENTRY


def test_multi_buffer_put_does_not_overwrite(store: MooncakeDistributedStore, arena: Arena, key: str) -> None:
    assert store.put(key, b"original") == OK
    arena.fill(300 * 1024, b"replacement, longer than the original")
    rc = store.batch_put_from_multi_buffers([key], [arena.spans([300 * 1024], [37])], [[37]])
    assert _int_list(rc) == [OK]  # reports success ...
    assert store.get(key) == b"original"  # ... but keeps the old value
    assert store.get_size(key) == 8


def test_multi_buffer_keyword_names_of_the_stub(
    store: MooncakeDistributedStore, binding: Binding, arena: Arena, key: str
) -> None:
    arena.fill(400 * 1024, b"kw")
    ptrs = [arena.spans([400 * 1024, 400 * 1024 + 1], [1, 1])]
    rc = store.batch_put_from_multi_buffers(
        keys=[key], all_buffer_ptrs=ptrs, all_sizes=[[1, 1]], config=binding.replicate_config()
    )
    assert _int_list(rc) == [OK]
    into = [arena.spans([410 * 1024], [2])]
    got = store.batch_get_into_multi_buffers(
        keys=[key], all_buffer_ptrs=into, all_sizes=[[2]], prefer_alloc_in_same_node=False
    )
    assert _int_list(got) == [2]
    assert arena.read(410 * 1024, 2) == b"kw"


def _stub_signatures() -> dict[str, list[tuple[str, str, bool]]]:
    """Each method of the stub's store class not overloaded: (name, kind, has a default) per
    parameter after ``self``."""
    tree = ast.parse(STUB.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MooncakeDistributedStore"]
    found: dict[str, list[tuple[str, str, bool]]] = {}
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef) or node.decorator_list:
            continue
        a = node.args
        positional = [*a.posonlyargs, *a.args]
        defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
        params = [
            (p.arg, "POSITIONAL_ONLY" if p in a.posonlyargs else "POSITIONAL_OR_KEYWORD", d)
            for p, d in zip(positional, defaults, strict=True)
        ]
        keyword_only = zip(a.kwonlyargs, a.kw_defaults, strict=True)
        params += [(p.arg, "KEYWORD_ONLY", d is not None) for p, d in keyword_only]
        found[node.name] = params[1:]
    return found


def test_fake_has_every_method_of_the_stub_with_its_parameters() -> None:
    stub = _stub_signatures()
    assert {"put", "get_into", "batch_get_into_multi_buffers"} <= set(stub)  # the parse found them
    assert hasattr(FakeMooncakeStore, "setup")  # overloaded in the stub: mypy checks its forms
    for name, params in stub.items():
        method = getattr(FakeMooncakeStore, name, None)
        assert method is not None, f"FakeMooncakeStore lacks {name}"
        signature = inspect.signature(method)
        fake = [
            (p.name, p.kind.name, p.default is not inspect.Parameter.empty)
            for p in list(signature.parameters.values())[1:]
        ]
        assert fake == params, name


def test_a_key_twice_in_one_batch_read_leaves_a_buffer_unfilled(
    store: MooncakeDistributedStore, arena: Arena, key: str
) -> None:
    """Why reads de-duplicate their keys first: both report success, one buffer stays as it was."""
    assert store.put(key, b"HELLO") == OK
    start = 500 * 1024
    arena.fill(start, bytes([SENTINEL]) * 128)
    got = store.batch_get_into([key, key], arena.spans([start, start + 64], [64, 64]), [64, 64])
    assert _int_list(got) == [5, 5]
    assert arena.read(start, 5) == bytes([SENTINEL]) * 5  # reported as read, never written
    assert arena.read(start + 64, 5) == b"HELLO"


# -- put sessions (put-if-absent) ---------------------------------------------------------------

SESSION_AT = 600 * 1024
"""Where in the arena the put session tests keep their bytes (the tests above use less)."""


@pytest.fixture(scope="module")
def other(binding: Binding, session_master: Master) -> Iterator[MooncakeDistributedStore]:
    """A second client of the module's master (no segment of its own)."""
    s = _setup(binding, session_master.address, segment=0)
    yield s
    assert s.close() == OK


def test_put_session_round_trip_with_ranged_offsets(
    store: MooncakeDistributedStore, arena: Arena, key: str
) -> None:
    keys = [key, key + "-b"]
    assert _int_list(store.batch_put_session_start(keys, [20, 7])) == [OK, OK]
    arena.fill(SESSION_AT, b"0123456789")
    arena.fill(SESSION_AT + 100, b"ABCDEFGHIJ")
    arena.fill(SESSION_AT + 200, b"session")
    # out of order, each buffer at its offset in the entry; one key per list entry
    ptrs = [arena.spans([SESSION_AT + 100, SESSION_AT], [10, 10]), arena.spans([SESSION_AT + 200], [7])]
    written = store.batch_put_from_multi_buffer_ranges(keys, ptrs, [[10, 10], [7]], [[10, 0], [0]])
    assert _int_list(written) == [20, 7]  # the bytes written per key
    assert store.is_exist(key) == 0  # written, not yet ended
    # a later write lands over an earlier one
    assert _int_list(
        store.batch_put_from_multi_buffer_ranges([key], [arena.spans([SESSION_AT], [2])], [[2]], [[18]])
    ) == [2]
    assert _int_list(store.batch_put_session_end(keys)) == [OK, OK]
    assert store.get_batch(keys) == [b"0123456789ABCDEFGH01", b"session"]
    assert store.get_size(key) == 20
    assert store.is_exist(key) == 1
    # the sessions are over: ending or revoking them again is refused, the keys are held
    assert _int_list(store.batch_put_session_end([key])) == [INVALID_PARAMS]
    assert _int_list(store.batch_put_session_revoke([key])) == [INVALID_PARAMS]
    assert _int_list(store.batch_put_session_start(keys, [20, 7])) == [OBJECT_ALREADY_EXISTS] * 2
    assert store.get(key) == b"0123456789ABCDEFGH01"


def test_put_session_start_codes(
    store: MooncakeDistributedStore, other: MooncakeDistributedStore, key: str
) -> None:
    assert store.put(key + "-held", b"v") == OK
    opened = [key, key + "-new", key + "-twice"]
    try:
        assert _int_list(store.batch_put_session_start([key + "-held"], [1])) == [OBJECT_ALREADY_EXISTS]
        assert _int_list(store.batch_put_session_start([key], [8])) == [OK]
        assert _int_list(other.batch_put_session_start([key], [8])) == [OBJECT_ALREADY_EXISTS]
        # this client's own open session: -600 (also twice in one call), the other keys go on
        started = store.batch_put_session_start([key, key + "-new", key], [8, 8, 8])
        assert _int_list(started) == [INVALID_PARAMS, OK, INVALID_PARAMS]
        # a key twice in one call, not open before it: the second start finds the first's session
        assert _int_list(store.batch_put_session_start([key + "-twice"] * 2, [4, 4])) == [
            OK,
            OBJECT_ALREADY_EXISTS,
        ]
        assert _int_list(store.batch_put_session_start([key + "-zero"], [0])) == [INVALID_PARAMS]
        assert _int_list(store.batch_put_session_start([""], [4])) == [INVALID_PARAMS]
        assert _int_list(store.batch_put_session_start([key + "-x", key + "-y"], [4])) == [INVALID_PARAMS] * 2
        assert _int_list(store.batch_put_session_start([key + "-huge"], [1 << 40])) == [NO_AVAILABLE_HANDLE]
        assert _int_list(store.batch_put_session_start([], [])) == []
        assert store.batch_is_exist([key + "-zero", key + "-x", key + "-huge"]) == [0, 0, 0]
    finally:
        assert _int_list(store.batch_put_session_revoke(opened)) == [OK] * 3


def test_put_session_start_race_has_one_winner(
    binding: Binding,
    session_master: Master,
    store: MooncakeDistributedStore,
    other: MooncakeDistributedStore,
    key: str,
) -> None:
    third = _setup(binding, session_master.address, segment=0)
    try:
        racers = [store, other, third]
        barrier = threading.Barrier(len(racers))
        codes: list[list[int]] = [[] for _ in racers]

        def race(i: int) -> None:
            barrier.wait()
            codes[i] = racers[i].batch_put_session_start([key], [8])

        threads = [threading.Thread(target=race, args=(i,)) for i in range(len(racers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(_int_list(c) for c in codes)
        assert sorted(c for (c,) in codes) == [OBJECT_ALREADY_EXISTS, OBJECT_ALREADY_EXISTS, OK]
        (winner,) = [r for r, (c,) in zip(racers, codes, strict=True) if c == OK]
        assert _int_list(winner.batch_put_session_revoke([key])) == [OK]
    finally:
        assert third.close() == OK


def test_a_closed_client_keeps_its_put_sessions(
    binding: Binding, session_master: Master, other: MooncakeDistributedStore, key: str
) -> None:
    """Closing does not revoke: the key stays reserved until the master's discard timeout."""
    leaving = _setup(binding, session_master.address, segment=0)
    try:
        assert _int_list(leaving.batch_put_session_start([key], [8])) == [OK]
    finally:
        assert leaving.close() == OK
    assert _int_list(other.batch_put_session_start([key], [8])) == [OBJECT_ALREADY_EXISTS]
    assert other.is_exist(key) == 0


def test_put_session_revoke_frees_the_key(
    store: MooncakeDistributedStore, other: MooncakeDistributedStore, arena: Arena, key: str
) -> None:
    assert _int_list(store.batch_put_session_start([key], [8])) == [OK]
    arena.fill(SESSION_AT, b"revoked!")
    assert _int_list(
        store.batch_put_from_multi_buffer_ranges([key], [arena.spans([SESSION_AT], [8])], [[8]], [[0]])
    ) == [8]
    # only its own client ends or revokes a session
    assert _int_list(other.batch_put_session_revoke([key])) == [INVALID_PARAMS]
    assert _int_list(other.batch_put_session_end([key])) == [INVALID_PARAMS]
    assert _int_list(store.batch_put_session_revoke([key, key + "-never"])) == [OK, INVALID_PARAMS]
    assert store.is_exist(key) == 0
    assert store.get(key) == b""
    assert _int_list(other.batch_put_session_start([key], [8])) == [OK]
    # the other client's session now: this client cannot write into it
    rc = store.batch_put_from_multi_buffer_ranges([key], [arena.spans([SESSION_AT], [8])], [[8]], [[0]])
    assert _int_list(rc) == [INVALID_PARAMS]
    assert _int_list(other.batch_put_session_revoke([key])) == [OK]
    assert _int_list(store.batch_put_session_start([key], [8])) == [OK]
    assert _int_list(store.batch_put_session_revoke([key])) == [OK]


def test_a_key_in_a_put_session_is_invisible(
    store: MooncakeDistributedStore, other: MooncakeDistributedStore, arena: Arena, key: str
) -> None:
    assert _int_list(store.batch_put_session_start([key], [8])) == [OK]
    arena.fill(SESSION_AT, b"SESSION!" + b"intruder")
    intruder = arena.spans([SESSION_AT + 8], [8])
    assert (store.is_exist(key), other.is_exist(key)) == (0, 0)
    assert store.batch_is_exist([key]) == [0]
    assert (store.get(key), other.get(key)) == (b"", b"")
    assert store.get_batch([key]) == [b""]
    assert store.get_replica_desc(key) == []
    assert store.get_size(key) == REPLICA_IS_NOT_READY
    assert store.get_into(key, intruder[0] + 64, 64) == REPLICA_IS_NOT_READY
    assert _int_list(
        store.batch_get_into_multi_buffers([key], [arena.spans([SESSION_AT + 64], [8])], [[8]])
    ) == [REPLICA_IS_NOT_READY]
    assert store.remove(key) == REPLICA_IS_NOT_READY
    assert store.remove(key, force=True) == REPLICA_IS_NOT_READY
    # plain puts report success and write nothing, from either client
    assert other.put(key, b"intruder") == OK
    assert store.put(key, b"intruder") == OK
    assert _int_list(store.batch_put_from_multi_buffers([key], [intruder], [[8]])) == [OK]
    assert store.put_batch([key], [b"intruder"]) == OK
    assert store.is_exist(key) == 0
    sent = store.batch_put_from_multi_buffer_ranges([key], [arena.spans([SESSION_AT], [8])], [[8]], [[0]])
    assert _int_list(sent) == [8]
    assert _int_list(store.batch_put_session_end([key])) == [OK]
    assert other.get(key) == b"SESSION!"


def test_put_session_short_write_keeps_the_reserved_size(
    store: MooncakeDistributedStore, arena: Arena, key: str
) -> None:
    """An end does not check that every byte was written: the value keeps the size reserved,
    and the bytes no write reached are whatever the holder's memory held (next test)."""
    assert _int_list(store.batch_put_session_start([key], [16])) == [OK]
    arena.fill(SESSION_AT, b"abcd")
    assert _int_list(
        store.batch_put_from_multi_buffer_ranges([key], [arena.spans([SESSION_AT], [4])], [[4]], [[2]])
    ) == [4]
    assert _int_list(store.batch_put_session_end([key])) == [OK]
    value = store.get(key)
    assert len(value) == 16
    assert value[2:6] == b"abcd"
    assert store.get_size(key) == 16


def test_put_session_bytes_not_written_are_not_zeroed(binding: Binding, fresh_master: Master) -> None:
    """A session's room reuses the memory of a freed value as it is: what a session never wrote
    reads back as that value's bytes (the fake: `UNWRITTEN_BYTE`), not as zeros."""
    s = _setup(binding, fresh_master.address)
    try:
        assert s.put("freed", b"\xff" * 5000) == OK
        assert s.remove("freed", force=True) == OK
        assert _int_list(s.batch_put_session_start(["unwritten"], [5000])) == [OK]
        assert _int_list(s.batch_put_session_end(["unwritten"])) == [OK]
        value = s.get("unwritten")
        assert len(value) == 5000
        assert value != bytes(5000)
    finally:
        assert s.close() == OK


def test_put_session_range_codes(store: MooncakeDistributedStore, arena: Arena, key: str) -> None:
    ptr = arena.spans([SESSION_AT], [8])[0]
    write = store.batch_put_from_multi_buffer_ranges
    assert _int_list(write([key], [[ptr]], [[8]], [[0]])) == [INVALID_PARAMS]  # no session
    assert _int_list(store.batch_put_session_start([key], [8])) == [OK]
    try:
        assert _int_list(write([key], [[ptr]], [[8]], [[1]])) == [INVALID_PARAMS]  # one byte past
        assert _int_list(write([key], [[ptr]], [[2]], [[8]])) == [INVALID_PARAMS]  # starts past
        assert _int_list(write([key], [[ptr, ptr]], [[2]], [[0]])) == [INVALID_PARAMS]  # per-key lengths
        assert _int_list(write([key, key + "-b"], [[ptr]], [[2]], [[0]])) == [INVALID_PARAMS] * 2
        assert _int_list(write([key], [[]], [[]], [[]])) == [INVALID_REPLICA]  # no ranges
        assert _int_list(write([key], [[ptr]], [[0]], [[0]])) == [0]
        assert _int_list(write([], [], [], [])) == []
        assert _int_list(write([key], [[ptr]], [[8]], [[0]])) == [8]  # the session is still usable
    finally:
        assert _int_list(store.batch_put_session_revoke([key])) == [OK]
    assert _int_list(store.batch_put_session_end([])) == []
    assert _int_list(store.batch_put_session_revoke([])) == []


def test_put_session_end_after_an_upsert_is_refused(
    store: MooncakeDistributedStore, other: MooncakeDistributedStore, arena: Arena, key: str
) -> None:
    assert _int_list(store.batch_put_session_start([key], [8])) == [OK]
    assert other.upsert(key, b"UPSERTED") == OK  # an upsert does not wait for the session
    assert store.is_exist(key) == 1
    arena.fill(SESSION_AT, b"session!")
    sent = store.batch_put_from_multi_buffer_ranges([key], [arena.spans([SESSION_AT], [8])], [[8]], [[0]])
    assert _int_list(sent) == [8]
    assert _int_list(store.batch_put_session_end([key])) == [ILLEGAL_CLIENT]
    assert _int_list(store.batch_put_session_revoke([key])) == [ILLEGAL_CLIENT]
    assert store.get(key) == b"UPSERTED"
    # the session stays open on its client until a revoke succeeds, once the key is gone
    assert _int_list(store.batch_put_session_start([key], [8])) == [INVALID_PARAMS]
    assert other.remove(key, force=True) == OK
    assert _int_list(store.batch_put_session_revoke([key])) == [OK]
    assert _int_list(store.batch_put_session_start([key], [8])) == [OK]
    assert _int_list(store.batch_put_session_revoke([key])) == [OK]


def test_put_session_keyword_names_of_the_stub(
    store: MooncakeDistributedStore, binding: Binding, arena: Arena, key: str
) -> None:
    arena.fill(SESSION_AT, b"kw")
    started = store.batch_put_session_start(
        keys=[key, key + "-r"], sizes=[2, 2], config=binding.replicate_config()
    )
    assert _int_list(started) == [OK, OK]
    sent = store.batch_put_from_multi_buffer_ranges(
        keys=[key],
        all_buffer_ptrs=[arena.spans([SESSION_AT + 1, SESSION_AT], [1, 1])],
        all_sizes=[[1, 1]],
        all_dst_offsets=[[1, 0]],
    )
    assert _int_list(sent) == [2]
    assert _int_list(store.batch_put_session_end(keys=[key])) == [OK]
    assert _int_list(store.batch_put_session_revoke(keys=[key + "-r"])) == [OK]
    assert store.get_batch([key, key + "-r"]) == [b"kw", b""]


def test_fake_master_discards_a_stale_put_session() -> None:
    """The fake's model of ``put_start_discard_timeout_sec`` (too slow to test on the real one):
    a reservation older than it gives way to the next start of its key."""
    clock = FakeClock()
    with FakeMooncakeMaster(put_start_discard_timeout_s=30.0, clock=clock) as master:
        clients = [FakeMooncakeStore(), FakeMooncakeStore()]
        for c in clients:
            assert c.setup("127.0.0.1", "P2PHANDSHAKE", MiB, MiB, "tcp", "", master.address) == OK
        first, second = clients
        assert first.batch_put_session_start(["k"], [8]) == [OK]
        assert master.reserved() == ["k"]
        assert second.batch_put_session_start(["k"], [8]) == [OBJECT_ALREADY_EXISTS]
        clock.advance(29.5)
        assert second.batch_put_session_start(["k"], [8]) == [OBJECT_ALREADY_EXISTS]
        clock.advance(0.5)
        assert second.batch_put_session_start(["k"], [8]) == [OK]
        assert first.batch_put_session_end(["k"]) == [ILLEGAL_CLIENT]  # no longer its session
        assert second.batch_put_session_end(["k"]) == [OK]
        assert master.reserved() == []
        assert master.keys() == ["k"]
        for c in clients:
            assert c.close() == OK


def test_fake_master_leases_run_out_by_its_clock() -> None:
    """A read's lease (``lease_s``) keeps its object from a plain remove until the master's
    clock passes it."""
    clock = FakeClock()
    with FakeMooncakeMaster(lease_s=10.0, clock=clock) as master:
        store = FakeMooncakeStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", MiB, MiB, "tcp", "", master.address) == OK
        try:
            assert store.put("leased", b"v") == OK
            assert store.get("leased") == b"v"
            clock.advance(9.5)
            assert store.remove("leased") == HAS_LEASE
            clock.advance(0.5)
            assert store.remove("leased") == OK
        finally:
            assert store.close() == OK
