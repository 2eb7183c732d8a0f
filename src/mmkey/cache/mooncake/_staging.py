"""Staging for Mooncake transfers: one registered buffer, its lease, and adaptive read slots.

Entries move between the store and a buffer registered with the binding (zero-copy
`batch_get_into` / `batch_upsert_from`). A batch read splits the buffer into equal slots,
one per key; the slot size follows the entries actually read, up after a large entry and
back down after reads of small ones, so one large entry does not make every later read go
one key per call.

The buffer is allocated once, already faulted in (``MAP_POPULATE``), and registered when
the store is set up (`Staging.prepare`, at construction), so no call pays for fresh memory:
on a host where other processes churn memory, a page fault there costs far more than the
copy that triggers it. Writes copy each payload through the codec's chunked copy while it
seals the entry (`stage_entry`), never torch's ``copy_``: that splits a 64 KiB copy across
its OpenMP threads, and on a CPU-saturated host each such copy waited about a millisecond
for a descheduled thread (measured: 256 copies took 216 ms median against 6.7 ms for a
plain ``memmove``).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mmkey._tensors import byte_view
from mmkey.entry.codec import encode_entry_into
from mmkey.errors import StoreError

if TYPE_CHECKING:
    import torch
    from mooncake.store import MooncakeDistributedStore

    from mmkey.entry.auth import EntryKeyring

__all__ = [
    "ALIGN",
    "MIN_SLOT",
    "ReadSlots",
    "Staging",
    "aligned",
    "faulted_in",
    "registered",
    "stage_entry",
]

ALIGN = 64
MIN_SLOT = 256 << 10
"""The smallest slot a read reserves per key."""


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGN`."""
    return -(-n // ALIGN) * ALIGN


class ReadSlots:
    """How many bytes a batch read reserves per key, adapted to the entries read.

    A read that finds an entry larger than the slot grows it to that entry at once; a read
    whose entries were all smaller halves it towards them, never below `MIN_SLOT`. Not
    thread-safe on its own: a stale value only costs an extra transfer, never a wrong entry.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slot = min(MIN_SLOT, capacity)

    def keys_per_transfer(self) -> int:
        """How many keys one transfer into a buffer of `capacity` bytes takes."""
        return max(1, self.capacity // self.slot)

    def slot_for(self, keys: int) -> int:
        """The slot each of `keys` keys gets in one transfer: the buffer split evenly."""
        return self.capacity // max(keys, 1) // ALIGN * ALIGN

    def observe(self, largest: int) -> None:
        """A read whose largest entry had `largest` bytes (0: nothing was found)."""
        if largest <= 0:
            return
        want = min(aligned(largest), self.capacity)
        if want >= self.slot:
            self.slot = want
        else:
            self.slot = max(min(MIN_SLOT, self.capacity), want, aligned(self.slot // 2))


def faulted_in(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh anonymous memory with every page already faulted in, as a uint8
    tensor (which keeps the mapping alive)."""
    import torch

    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    memory = mmap.mmap(-1, nbytes, flags=flags)
    if not getattr(mmap, "MAP_POPULATE", 0):  # not Linux: touch every page once instead
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(memory)), 0, nbytes)
    return torch.frombuffer(memory, dtype=torch.uint8)


class _RegistrationRefused(RuntimeError):
    """This client could not register a buffer of its own (its memory, not the master): the
    one transfer that needed it is a counted miss or failed write, and no store fault."""


@contextlib.contextmanager
def registered(store: MooncakeDistributedStore, buf: torch.Tensor) -> Iterator[int]:
    """Register `buf` with the store for a zero-copy transfer; yields its address.
    ``_RegistrationRefused`` where the store refuses."""
    ptr = buf.data_ptr()
    code = store.register_buffer(ptr, buf.numel())
    if code != 0:
        raise _RegistrationRefused(f"register_buffer of {buf.numel()} bytes refused ({code})")
    try:
        yield ptr
    finally:
        store.unregister_buffer(ptr)


def stage_entry(
    staging: Staging, at: int, size: int, text: str, tensor: torch.Tensor, keyring: EntryKeyring | None
) -> None:
    """Write the entry of `tensor` under key text `text` into prepared `staging` at offset
    `at`; `size` is its `entry_size`. The codec copies the payload chunk by chunk while it
    seals it (no torch copy, whose threads stall on a busy host)."""
    encode_entry_into(staging.view_prepared()[at : at + size], text, tensor, keyring=keyring)


class Staging:
    """A registered transfer buffer and the lease that guards it.

    The lease is held from a transfer into the buffer until its caller has decoded the
    entries (or, for writes, until the entries are flushed), so no other transfer overwrites
    the buffer meanwhile. Registration and unregistration run on the store's worker.
    """

    def __init__(self, nbytes: int, slots: ReadSlots | None = None) -> None:
        self.nbytes = nbytes
        self.lease = threading.Lock()
        self.slots = ReadSlots(nbytes) if slots is None else slots
        """The read slot size; lanes of one store share it (it is about the entries)."""
        self._tensor: torch.Tensor | None = None
        self._view: memoryview | None = None
        self.ptr = 0

    def prepare(self, store: MooncakeDistributedStore) -> None:
        """Allocate the buffer (faulted in) and register it with `store`, once: at set-up."""
        if self._view is not None:
            return
        buf = faulted_in(self.nbytes)
        if store.register_buffer(buf.data_ptr(), buf.numel()) != 0:
            raise StoreError("register_buffer of the staging buffer failed")
        self._tensor, self._view, self.ptr = buf, byte_view(buf, writable=True), buf.data_ptr()

    def view(self, store: MooncakeDistributedStore) -> memoryview:
        """The registered buffer (prepared now if set-up did not)."""
        if self._view is None:
            self.prepare(store)
        return self.view_prepared()

    def view_prepared(self) -> memoryview:
        """The registered buffer; `StoreError` if it was never prepared (or was dropped)."""
        view = self._view
        if view is None:
            raise StoreError("the staging buffer is not prepared")
        return view

    def unregister(self, store: MooncakeDistributedStore) -> None:
        """Unregister the buffer from `store` and drop it (on a store about to close)."""
        if self._view is not None:
            store.unregister_buffer(self.ptr)
        self._tensor, self._view, self.ptr = None, None, 0

    def detach(self) -> torch.Tensor | None:
        """Forget the buffer without unregistering it; returns it (keep it alive while the
        store that registered it lives)."""
        tensor, self._tensor, self._view, self.ptr = self._tensor, None, None, 0
        return tensor
