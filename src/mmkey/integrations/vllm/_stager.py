"""`Stager`: the vLLM scheduler side's fetches, off the scheduler's thread, into host memory.

The scheduler never waits on the store: `want` queues a key and returns; one daemon thread
asks the cache for everything queued in one call (`get_embeddings`, verified, for consumers;
`batch_is_exist` for producers that only skip what is stored) and files each answer. An item
is `Staged.STAGED` only when its verified tensor, of the expected number of rows, is held
here; staged bytes are bounded (an item past the budget is `Staged.MISSING`: it is encoded).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from mmkey._log import Counters
from mmkey.cache.protocol import EmbeddingCache
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    import torch

__all__ = ["Staged", "Stager", "StagerCounts"]

_CALL_BYTES = 64 << 20


class Staged(enum.Enum):
    """Where one item stands."""

    PENDING = "pending"
    """Asked for, no answer yet."""
    STAGED = "staged"
    """Verified and held here (or, for an existence check, known stored)."""
    MISSING = "missing"
    """Not stored, not valid, of another size, over the budget, or the store failed."""


@attrs.define(slots=True)
class _Entry:
    key: EmbeddingKey
    rows: int
    state: Staged = Staged.PENDING
    tensor: torch.Tensor | None = None
    nbytes: int = 0


@attrs.frozen(slots=True)
class StagerCounts:
    """What a `Stager` did since it was made (a snapshot)."""

    asked: int = 0
    """Items asked of the store."""
    staged: int = 0
    """Items found, verified and of the right size."""
    wrong_size: int = 0
    """Items found with another number of rows than expected."""
    over_budget: int = 0
    """Items found but not held: the staged bytes were at their budget."""
    store_errors: int = 0
    """Store calls that raised (every item of the call is missing)."""
    staged_bytes: int = 0
    """Bytes held now."""


class Stager:
    """Fetches of keyed items on one daemon thread, held until `release`.

    `fetch=True` reads and verifies entries (consumers); `fetch=False` only checks that they
    exist (producers that skip stored items). `on_error(message)` is called on the thread for
    a failed store call and must not raise.
    """

    def __init__(
        self,
        cache: EmbeddingCache,
        *,
        fetch: bool,
        max_bytes: int,
        on_error: Callable[[str], None] = lambda _: None,
        name: str = "mmkey-vllm-stager",
    ) -> None:
        self._cache = cache
        self._fetch = fetch
        self._budget = max_bytes
        self._on_error = on_error
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._queue: list[str] = []
        self._bytes = 0
        self._closed = False
        self._counts = Counters()  # named as the fields of StagerCounts
        self._entry_bytes = 8 << 20  # a guess until the first entry is read
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def want(self, name: str, key: EmbeddingKey, rows: int) -> Staged:
        """Start fetching `key` under `name` (expecting `rows` rows) unless known; its state."""
        with self._cond:
            entry = self._entries.get(name)
            if entry is not None and entry.key == key and entry.rows == rows:
                return entry.state
            if entry is not None:
                self._drop(name)
            self._entries[name] = _Entry(key, rows)
            self._queue.append(name)
            self._cond.notify_all()
            return Staged.PENDING

    def retry(self, name: str) -> None:
        """Ask again for a `MISSING` item (it may have been stored since)."""
        with self._cond:
            entry = self._entries.get(name)
            if entry is not None and entry.state is Staged.MISSING:
                entry.state = Staged.PENDING
                self._queue.append(name)
                self._cond.notify_all()

    def state(self, name: str) -> Staged | None:
        """The state of `name`, or ``None`` when it was never asked for or was released."""
        entry = self._entries.get(name)  # one dict read: no lock on the scheduler's path
        return None if entry is None else entry.state

    def take(self, name: str) -> torch.Tensor | None:
        """The staged tensor of `name`, handed over: `name` is forgotten here."""
        with self._cond:
            entry = self._entries.get(name)
            if entry is None or entry.state is not Staged.STAGED:
                return None
            tensor = entry.tensor
            self._drop(name)
            return tensor

    def release(self, name: str) -> None:
        """Forget `name` and free what it held."""
        with self._cond:
            self._drop(name)

    def _drop(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            entry.tensor = None

    def answered(self) -> int:
        """How many answers this stager has filed (grows as fetches complete)."""
        return self._counts.totals().get("asked", 0)

    def counts(self) -> StagerCounts:
        """A snapshot of the counters."""
        with self._cond:
            return StagerCounts(**self._counts.totals(), staged_bytes=self._bytes)

    def close(self) -> None:
        """Stop the thread (after its current call) and free everything held."""
        with self._cond:
            self._closed = True
            self._entries.clear()
            self._queue.clear()
            self._bytes = 0
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                names = list(dict.fromkeys(self._queue))
                self._queue.clear()
                asked = [(n, self._entries[n]) for n in names if n in self._entries]
            # calls of about _CALL_BYTES each, so that every call fits the store's timeout and
            # the first answers are usable before the last are read
            per_call = max(1, _CALL_BYTES // self._entry_bytes) if self._fetch else len(asked)
            for start in range(0, len(asked), per_call):
                self._answer(asked[start : start + per_call])

    def _answer(self, asked: list[tuple[str, _Entry]]) -> None:
        keys = [entry.key for _, entry in asked]
        tensors: list[torch.Tensor | None] = [None] * len(keys)
        present: list[bool] = [False] * len(keys)
        failed = False
        try:
            if self._fetch:
                got = self._cache.get_embeddings(keys)
                if len(got) == len(keys):
                    tensors = list(got)
            else:
                found = self._cache.batch_is_exist(keys)
                if len(found) == len(keys):
                    present = list(found)
        except Exception as exc:  # a store fault is a miss for every item asked
            failed = True
            self._on_error(f"{len(keys)} lookup(s) raised {type(exc).__name__}: {exc}")
        with self._cond:
            self._counts.add(asked=len(keys), store_errors=int(failed))
            for (name, entry), tensor, exists in zip(asked, tensors, present, strict=True):
                if self._entries.get(name) is not entry or entry.state is not Staged.PENDING:
                    continue  # released or replaced meanwhile
                entry.state = self._file(entry, tensor, exists)
            self._cond.notify_all()

    def _file(self, entry: _Entry, tensor: torch.Tensor | None, exists: bool) -> Staged:
        if not self._fetch:
            return Staged.STAGED if exists else Staged.MISSING
        if tensor is None:
            return Staged.MISSING
        if tensor.ndim < 1 or tensor.shape[0] != entry.rows:
            self._counts.add(wrong_size=1)
            return Staged.MISSING
        nbytes = tensor.numel() * tensor.element_size()
        self._entry_bytes = max(nbytes, 1)
        if self._bytes + nbytes > self._budget:
            self._counts.add(over_budget=1)
            return Staged.MISSING
        entry.tensor = _pinned(tensor)
        entry.nbytes = nbytes
        self._bytes += nbytes
        self._counts.add(staged=1)
        return Staged.STAGED


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in page-locked memory where a CUDA device can use it, else as it is."""
    import torch

    if tensor.device.type == "cpu" and torch.cuda.is_available():
        try:
            return tensor.pin_memory()
        except RuntimeError:
            return tensor
    return tensor
