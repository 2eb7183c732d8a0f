"""Write pipelines for `MooncakeCache`: entries sealed into staging, or sent from registered memory.

`Writer.write` seals entries into a lane's staging buffer and upserts them in batches (an
entry larger than the buffer gets a registered buffer of its own). `Writer.write_from` sends
payloads that lie in memory registered with the store straight from it, a header from
staging beside them, when the key is new (Mooncake's multi-buffer put never replaces an
entry), and sends the rest through `write`. Every write asks the store for
``config.replica_num`` copies.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from mmkey._tensors import byte_view, host_ready, nbytes_of
from mmkey.cache.mooncake._parts import CacheParts
from mmkey.cache.mooncake._staging import Staging, aligned, registered, stage_entry
from mmkey.cache.mooncake._transport import RPC_FAILURES, Pending, out_of_time
from mmkey.entry.codec import encode_entry_into, entry_header, entry_size
from mmkey.errors import StoreError

if TYPE_CHECKING:
    import torch
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

__all__ = ["Writer"]

_PUT_CHUNK = 64 << 20
"""Payload bytes sealed and sent per multi-buffer put."""


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


class Writer:
    """Runs the writes of one `MooncakeCache` over its transport."""

    def __init__(self, parts: CacheParts) -> None:
        self._parts = parts
        self._replicas: ReplicateConfig | None = None  # made on first write

    def write(self, texts: list[str], tensors: list[torch.Tensor], give_up: float) -> dict[str, bool]:
        """Upsert entries through the staging buffer on the worker, within one timeout."""
        keyring = self._parts.keyring
        sizes = [entry_size(text, t, keyring=keyring) for text, t in zip(texts, tensors, strict=True)]
        ready = host_ready(tensors)  # CUDA tensors: an event on the caller's current stream
        # The worker reads the caller's tensors only while holding `reading`, and never
        # after the caller stopped waiting (`released`): a caller that timed out may reuse
        # its tensors at once, and a late encode would store that new data under old keys.
        reading = threading.Lock()
        released = threading.Event()

        def encode(target: memoryview, text: str, tensor: torch.Tensor) -> None:
            with reading:
                if released.is_set():
                    raise StoreError("insert_batch stopped waiting; its tensors are not read")
                encode_entry_into(target, text, tensor, keyring=keyring)

        def stage(staging: Staging, at: int, size: int, text: str, tensor: torch.Tensor) -> None:
            with reading:
                if released.is_set():
                    raise StoreError("insert_batch stopped waiting; its tensors are not read")
                stage_entry(staging, at, size, text, tensor, keyring)

        def write(store: MooncakeDistributedStore, lane_staging: Staging) -> dict[str, bool]:
            ready.wait()  # the caller's kernels writing the tensors have finished
            lane_staging.view(store)  # prepared at set-up; this only checks
            if not lane_staging.lease.acquire(timeout=max(give_up - time.monotonic(), 0.0)):
                raise TimeoutError("the staging buffer stayed busy past the call's deadline")
            try:
                return fill_and_flush(store, lane_staging)
            finally:
                lane_staging.lease.release()

        def fill_and_flush(store: MooncakeDistributedStore, staging: Staging) -> dict[str, bool]:
            stored: dict[str, bool] = {}
            batch: list[tuple[str, int, int]] = []  # key text, offset, size
            used = 0
            for text, t, size in zip(texts, tensors, sizes, strict=True):
                if size > staging.nbytes:
                    out_of_time(give_up)
                    stored[text] = self._write_large_on_worker(store, text, t, size, encode)
                    continue
                if used + size > staging.nbytes:
                    out_of_time(give_up)
                    stored.update(self._flush_on_worker(store, staging.ptr, batch))
                    batch, used = [], 0
                stage(staging, used, size, text, t)
                batch.append((text, used, size))
                used += aligned(size)
            stored.update(self._flush_on_worker(store, staging.ptr, batch))
            return stored

        try:
            if not self._parts.transport.ready(give_up):
                return {}
            lane = self._parts.transport.pick_lane(set())
            if lane is None:
                self._parts.skipped("every transfer lane stuck")
                return {}
            outcome = self._parts.transport.finish(self._parts.transport.submit(lane, write), give_up)
            return {} if isinstance(outcome, BaseException) else outcome
        finally:
            # Flag first, then wait out the entry being staged right now, if any: a lane that
            # re-takes `reading` entry after entry would otherwise keep a late caller waiting
            # (the lock is not fair), well past its deadline on a busy host.
            released.set()
            with reading:
                pass

    def write_from(self, latest: dict[str, list[torch.Tensor]], give_up: float) -> dict[str, bool]:
        """Store payloads held in runs: straight from registered memory when the key is new,
        through staging otherwise (Mooncake's multi-buffer put never replaces an entry)."""
        direct: dict[str, list[torch.Tensor]] = {}
        staged: dict[str, list[torch.Tensor]] = {}
        for text, runs in latest.items():
            in_place = all(
                self._parts.transport.region_of(t.data_ptr(), nbytes_of(t)) is not None
                for t in runs
                if nbytes_of(t)
            )
            (direct if in_place else staged)[text] = runs
        stored: dict[str, bool] = {}
        if direct:
            texts = list(direct)
            transport = self._parts.transport

            def look(store: MooncakeDistributedStore) -> tuple[bool, list[int]]:
                return transport.register_regions(store), store.batch_is_exist(texts)

            looked = transport.meta(look, give_up)
            if looked is None:
                return stored
            registered_now, codes = looked
            if not RPC_FAILURES.isdisjoint(codes):
                transport.fail()
                return stored
            for text, code in zip(texts, codes, strict=False):  # unanswered keys: not stored
                if code == 1 or not registered_now:
                    staged[text] = direct.pop(text)
            stored.update(self._put_direct(direct, give_up))
        if staged:
            import torch

            tensors = [runs[0] if len(runs) == 1 else torch.cat(runs) for runs in staged.values()]
            stored.update(self.write(list(staged), tensors, give_up))
        return stored

    def _put_direct(self, payloads: dict[str, list[torch.Tensor]], give_up: float) -> dict[str, bool]:
        """Multi-buffer puts of header (from a lane's staging) and payload runs (from the
        caller's registered memory), one chunk at a time: the caller's thread seals the next
        chunk while a lane moves the one before."""
        stored: dict[str, bool] = {}
        if not payloads or not self._parts.transport.ready(give_up):
            return stored
        taken: set[int] = set()
        inflight: deque[Pending[dict[str, bool]]] = deque()

        def drain_one() -> None:
            pending = inflight.popleft()
            outcome = self._parts.transport.finish(pending, give_up)
            if not isinstance(outcome, BaseException):
                stored.update(outcome)
                taken.discard(self._parts.transport.lanes.index(pending.lane))

        for chunk in _put_chunks(payloads):
            if time.monotonic() >= give_up:
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
                self._put_direct_on_worker, headers=headers, payloads=chunk, give_up=give_up
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
    ) -> dict[str, bool]:
        staging = lane_staging.view(store)
        if not lane_staging.lease.acquire(timeout=max(give_up - time.monotonic(), 0.0)):
            raise TimeoutError("the staging buffer stayed busy past the call's deadline")
        try:
            out_of_time(give_up)
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
            codes = self._placed(store.batch_put_from_multi_buffers, keys, ptrs, sizes)
            # strict=False: keys the binding's answer leaves out are not stored
            return {text: code == 0 for text, code in zip(keys, codes, strict=False)}
        finally:
            lane_staging.lease.release()

    def _placed(self, write: Callable[..., list[int]], *args: object) -> list[int]:
        """`write(*args)` (a batch write of the binding) with `config.replica_num` copies
        (Mooncake's default placement for one); `StoreError` if the master did not answer."""
        one_copy = self._parts.config.replica_num == 1
        codes = write(*args) if one_copy else write(*args, self._replicate())
        if not RPC_FAILURES.isdisjoint(codes):
            name = getattr(write, "__name__", "batch write")
            raise StoreError(f"{name}: master unreachable ({codes[0]})")
        return codes

    def _replicate(self) -> ReplicateConfig:
        """Mooncake's per-write placement settings: `config.replica_num` copies."""
        if self._replicas is None:
            from mooncake.store import ReplicateConfig

            replicas = ReplicateConfig()
            replicas.replica_num = self._parts.config.replica_num
            self._replicas = replicas
        return self._replicas

    def _flush_on_worker(
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

    def _write_large_on_worker(
        self,
        store: MooncakeDistributedStore,
        text: str,
        tensor: torch.Tensor,
        size: int,
        encode: Callable[[memoryview, str, torch.Tensor], None],
    ) -> bool:
        import torch

        buf = torch.empty(size, dtype=torch.uint8)
        encode(byte_view(buf, writable=True), text, tensor)
        with registered(store, buf) as ptr:
            if self._parts.config.replica_num == 1:
                code = store.upsert_from(text, ptr, size)
            else:
                code = store.upsert_from(text, ptr, size, self._replicate())
        if code in RPC_FAILURES:
            raise StoreError(f"upsert_from: master unreachable ({code})")
        return code == 0
