"""The Mooncake binding and `FakeMooncakeStore` agree on a batch whose per-key lists differ in
length: every key is refused with `INVALID_PARAMS` and nothing is written or read.

Each test runs against the real binding (with a local master) and against the fake.
"""

from __future__ import annotations

import ctypes
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

MiB = 1 << 20
OK = 0
INVALID_PARAMS = -600
SIZE = 4096


@pytest.fixture(scope="module", params=[pytest.param("real", marks=pytest.mark.mooncake), "fake"])
def store(request: pytest.FixtureRequest) -> Iterator[MooncakeDistributedStore]:
    """A client of a fresh master: the real binding's, or the fake's."""
    if request.param == "real":
        from mooncake.store import MooncakeDistributedStore

        master = request.getfixturevalue("mooncake_master_session")
        real = MooncakeDistributedStore()
        assert real.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MiB, 64 * MiB, "tcp", "", master.address) == OK
        yield real
        real.close()
        return
    with FakeMooncakeMaster() as fake_master:
        fake = FakeMooncakeStore()
        assert (
            fake.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MiB, 64 * MiB, "tcp", "", fake_master.address) == OK
        )
        yield fake
        fake.close()


@pytest.fixture
def buffer(store: MooncakeDistributedStore) -> Iterator[int]:
    """The address of a registered buffer of `SIZE` bytes, filled with b"x"."""
    data = bytearray(b"x" * SIZE)
    view = (ctypes.c_char * SIZE).from_buffer(data)  # pins the memory while registered
    base = ctypes.addressof(view)
    assert store.register_buffer(base, SIZE) == OK
    yield base
    assert store.unregister_buffer(base) == OK
    del view


Batch = Callable[["MooncakeDistributedStore", list[str], int], list[int]]

# each batch call with two keys and one pointer and one size (or one list of each)
WRITES: dict[str, Batch] = {
    "batch_put_from": lambda s, keys, p: s.batch_put_from(keys, [p], [8]),
    "batch_upsert_from": lambda s, keys, p: s.batch_upsert_from(keys, [p], [8]),
    "batch_put_from_multi_buffers": lambda s, keys, p: s.batch_put_from_multi_buffers(keys, [[p]], [[8]]),
}
READS: dict[str, Batch] = {
    "batch_get_into": lambda s, keys, p: s.batch_get_into(keys, [p], [8]),
    "batch_get_into_multi_buffers": lambda s, keys, p: s.batch_get_into_multi_buffers(keys, [[p]], [[8]]),
}


@pytest.mark.parametrize("name", sorted(WRITES))
def test_a_write_batch_of_unequal_lengths_stores_nothing(
    store: MooncakeDistributedStore, buffer: int, name: str
) -> None:
    keys = [f"lengths-{uuid.uuid4().hex}", f"lengths-{uuid.uuid4().hex}"]
    assert WRITES[name](store, keys, buffer) == [INVALID_PARAMS, INVALID_PARAMS]
    assert store.batch_is_exist(keys) == [0, 0]


@pytest.mark.parametrize("name", sorted(READS))
def test_a_read_batch_of_unequal_lengths_reads_nothing(
    store: MooncakeDistributedStore, buffer: int, name: str
) -> None:
    keys = [f"lengths-{uuid.uuid4().hex}", f"lengths-{uuid.uuid4().hex}"]
    assert store.put(keys[0], b"12345678") == OK
    assert store.put(keys[1], b"abcdefgh") == OK
    assert READS[name](store, keys, buffer) == [INVALID_PARAMS, INVALID_PARAMS]
    assert ctypes.string_at(buffer, 8) == b"x" * 8
