"""`Stager`: the vLLM scheduler side's fetches, off the scheduler's thread, into host memory.

The scheduler never waits on the store: `want` queues a key and returns; one daemon thread
asks the cache for everything queued in one call (`get_embeddings`, verified, for consumers;
`batch_is_exist` for producers that only skip what is stored) and files each answer. An item
is `Staged.STAGED` only when its verified tensor, of the expected number of rows, is held
here; staged bytes are bounded (an item past the budget is `Staged.MISSING`: it is encoded).

Single-flight, where the cache supports claims (`claims_on`) and this side's instance encodes
what is missing: an item found missing is claimed on the same thread (`ClaimingCache.claim`, a
store call within its timeout). Won: `Staged.MISSING` (encode it here), the claim held until
its save is written (`release_claims`), its request lets go without a save (`abandon`) or its
hold ends (`expire_claims`). Held elsewhere: `Staged.HELD`, asked again on `retry` (does it
exist yet? then fetched, verified; else claimed again, so a claimant that gave up is taken over).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from mmkey._log import Counters
from mmkey.cache.protocol import Claim, ClaimingCache, EmbeddingCache
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    import torch

__all__ = ["Staged", "Stager", "StagerCounts", "claim_wait_of"]

_CALL_BYTES = 64 << 20


class Staged(enum.Enum):
    """Where one item stands."""

    PENDING = "pending"
    """Asked for, no answer yet."""
    STAGED = "staged"
    """Verified and held here (or, for an existence check, known stored)."""
    MISSING = "missing"
    """Not stored, not valid, of another size, over the budget, or the store failed."""
    HELD = "held"
    """Not stored yet, and claimed by another claimant (another instance, or another caller
    of this cache) that is encoding it: wait for its entry, bounded, asking again on `retry`."""


def claim_wait_of(cache: EmbeddingCache) -> float:
    """The cache's ``claim_wait`` where it supports claims and has them on, else 0.0."""
    if not isinstance(cache, ClaimingCache):
        return 0.0
    try:
        wait: object = cache.claim_wait
    except Exception:  # a cache is an optimisation: no claims
        return 0.0
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait <= 0:
        return 0.0
    return float(wait)


@attrs.define(slots=True)
class _Entry:
    key: EmbeddingKey
    rows: int
    text: str = ""
    state: Staged = Staged.PENDING
    tensor: torch.Tensor | None = None
    nbytes: int = 0
    claim: bool = True
    """Whether a miss of it is claimed (else a `Staged.HELD` item stays held until it lands)."""
    recheck: bool = False
    """Asked again after `Staged.HELD`: is it stored yet (then fetched), else claimed again."""


@attrs.define(slots=True)
class _Won:
    """A claim this stager won: held until its save is written, at the latest until `until`."""

    key: EmbeddingKey
    until: float
    saving: bool = False
    """Its save is planned: a request that lets go does not release it (the save does)."""


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
    claims_won: int = 0
    """Missing items this side claimed (single-flight): encoded here, released after the save."""
    claims_held: int = 0
    """Answers that a missing item is claimed elsewhere (its requests wait for the entry)."""


class Stager:
    """Fetches of keyed items on one daemon thread, held until `release`.

    `fetch=True` reads and verifies entries (consumers); `fetch=False` only checks that they
    exist (producers that skip stored items). `on_error(message)` is called on the thread for
    a failed store call and must not raise. `claims`: claim missing items (the cache must be a
    `ClaimingCache`); a won claim is held at most `hold_s` seconds of `clock` (monotonic).
    """

    def __init__(
        self,
        cache: EmbeddingCache,
        *,
        fetch: bool,
        max_bytes: int,
        on_error: Callable[[str], None] = lambda _: None,
        name: str = "mmkey-vllm-stager",
        claims: bool = False,
        hold_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cache = cache
        self._fetch = fetch
        self._claiming: ClaimingCache | None = cache if claims and isinstance(cache, ClaimingCache) else None
        self._hold = hold_s
        self._clock = clock
        self._won: dict[str, _Won] = {}
        """Claims won and not released, by key text (oldest first)."""
        self._budget = max_bytes
        self._on_error = on_error
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._queue: list[str] = []
        self._bytes = 0
        self._closed = False
        self._calling = False  # the thread is in a store call
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
            self._entries[name] = _Entry(key, rows, key.to_key())
            self._queue.append(name)
            self._cond.notify_all()
            return Staged.PENDING

    def idle(self) -> bool:
        """Whether the thread has nothing queued and no store call under way (a new item is
        asked at once)."""
        with self._cond:
            return not self._queue and not self._calling

    def wait_answered(self, names: list[str], timeout: float) -> bool:
        """Wait at most `timeout` seconds (of the wall's monotonic clock, however many other
        answers come meanwhile) until none of `names` is `Staged.PENDING`; whether none is."""

        def answered() -> bool:
            return self._closed or all(
                (entry := self._entries.get(name)) is None or entry.state is not Staged.PENDING
                for name in names
            )

        with self._cond:
            return self._cond.wait_for(answered, timeout)

    def retry(self, name: str, *, claim: bool = True) -> None:
        """Ask again for a `MISSING` or `HELD` item (it may have been stored since); `claim`:
        whether a `HELD` item still missing is claimed again (else it stays held)."""
        with self._cond:
            entry = self._entries.get(name)
            if entry is not None and entry.state in (Staged.MISSING, Staged.HELD):
                entry.recheck = entry.state is Staged.HELD
                entry.claim = claim
                entry.state = Staged.PENDING
                self._queue.append(name)
                self._cond.notify_all()

    def won(self, name: str) -> bool:
        """Whether this stager holds the claim of `name`'s key (it is encoded here)."""
        entry = self._entries.get(name)
        return entry is not None and entry.text in self._won

    def give_back(self, name: str) -> None:
        """Release the claim won for `name` (unless its save is planned): `name` is `HELD`,
        asked again without claiming until `retry` says otherwise."""
        with self._cond:
            entry = self._entries.get(name)
            won = None if entry is None else self._won.get(entry.text)
            if entry is None or won is None or won.saving or entry.state is not Staged.MISSING:
                return
            del self._won[entry.text]
            entry.state, entry.claim = Staged.HELD, False
        self._release([won.key])

    def saving(self, text: str) -> None:
        """The save of the key `text` is planned: its claim is released when the save is done."""
        with self._cond:
            won = self._won.get(text)
            if won is not None:
                won.saving = True

    def abandon(self, name: str, *, force: bool = False) -> None:
        """`name`'s last request let go: release its claim unless its save is planned (or
        `force`: the save was called off)."""
        with self._cond:
            entry = self._entries.get(name)
            won = None if entry is None else self._won.get(entry.text)
            if entry is None or won is None or (won.saving and not force):
                return
            del self._won[entry.text]
        self._release([won.key])

    def release_claims(self, texts: object) -> int:
        """Release the claims won on the key texts `texts` (their saves are done); how many."""
        if not isinstance(texts, (set, frozenset, list, tuple)):
            return 0
        with self._cond:
            keys = [self._won.pop(text).key for text in texts if isinstance(text, str) and text in self._won]
        self._release(keys)
        return len(keys)

    def expire_claims(self, most: int = 4096) -> None:
        """Release the claims held past their hold, and the oldest past `most` claims."""
        now = self._clock()
        with self._cond:
            if not self._won:
                return
            late: list[str] = []
            for text, won in self._won.items():  # oldest first: the first still held ends the look
                if won.until > now and len(self._won) - len(late) <= most:
                    break
                late.append(text)
            keys = [self._won.pop(text).key for text in late]
        self._release(keys)

    def claims(self) -> list[str]:
        """The key texts whose claims this stager holds."""
        with self._cond:
            return list(self._won)

    def _release(self, keys: list[EmbeddingKey]) -> None:
        """Tell the cache (without waiting) that these claims are given up."""
        if keys and self._claiming is not None:
            try:
                self._claiming.release(keys)
            except Exception as exc:  # a closed or failing cache: its leases end with it
                self._on_error(f"{len(keys)} claim release(s) raised {type(exc).__name__}: {exc}")

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
        """Stop the thread (after its current call), release every claim, free everything held."""
        with self._cond:
            self._closed = True
            self._entries.clear()
            self._queue.clear()
            self._bytes = 0
            keys = [won.key for won in self._won.values()]
            self._won.clear()
            self._cond.notify_all()
        self._release(keys)

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
                self._calling = True
            # calls of about _CALL_BYTES each, so that every call fits the store's timeout and
            # the first answers are usable before the last are read
            per_call = max(1, _CALL_BYTES // self._entry_bytes) if self._fetch else len(asked)
            try:
                for start in range(0, len(asked), per_call):
                    self._answer(asked[start : start + per_call])
            finally:
                with self._cond:
                    self._calling = False

    def _answer(self, asked: list[tuple[str, _Entry]]) -> None:
        keys = [entry.key for _, entry in asked]
        tensors: list[torch.Tensor | None] = [None] * len(keys)
        present: list[bool] = [False] * len(keys)
        failed = False
        try:
            if self._fetch:
                present, tensors = self._fetched(asked)
            else:
                found = self._cache.batch_is_exist(keys)
                if len(found) == len(keys):
                    present = list(found)
        except Exception as exc:  # a store fault is a miss for every item asked
            failed = True
            self._on_error(f"{len(keys)} lookup(s) raised {type(exc).__name__}: {exc}")
        claims = {} if failed else self._claim(asked, tensors, present)
        orphans: list[EmbeddingKey] = []
        with self._cond:
            self._counts.add(asked=len(keys), store_errors=int(failed))
            counted: set[str] = set()  # (two names of one key share its claim)
            for (name, entry), tensor, exists in zip(asked, tensors, present, strict=True):
                answer = claims.get(entry.text)
                if answer is not None and entry.text not in counted:
                    counted.add(entry.text)
                    if answer is Claim.WON:
                        self._counts.add(claims_won=1)
                        self._won.pop(entry.text, None)  # (kept oldest first: `expire_claims`)
                        self._won[entry.text] = _Won(entry.key, self._clock() + self._hold)
                    elif answer is Claim.HELD:
                        self._counts.add(claims_held=1)
                if self._entries.get(name) is not entry or entry.state is not Staged.PENDING:
                    continue  # released or replaced meanwhile

                waits = answer is None and not failed and self._waits(entry, tensor, exists)
                if answer is Claim.HELD or waits:
                    entry.state = Staged.HELD
                else:
                    entry.state = self._file(entry, tensor, exists)
                entry.recheck = False
            wanted = {e.text for e in self._entries.values()} if counted else set()
            for text in counted:  # won for names all released meanwhile: nobody wants it now
                if claims[text] is Claim.WON and text not in wanted and text in self._won:
                    orphans.append(self._won.pop(text).key)
            self._cond.notify_all()
        self._release(orphans)

    def _fetched(self, asked: list[tuple[str, _Entry]]) -> tuple[list[bool], list[torch.Tensor | None]]:
        """Whether each item is known stored (items asked again after `Staged.HELD`: looked up
        first, the rest only read) and its verified tensor, or None."""
        present = [False] * len(asked)
        tensors: list[torch.Tensor | None] = [None] * len(asked)
        read = list(range(len(asked)))
        rechecks = [i for i, (_, entry) in enumerate(asked) if entry.recheck]
        if rechecks:
            found = self._cache.batch_is_exist([asked[i][1].key for i in rechecks])
            if len(found) == len(rechecks):
                absent = {i for i, exists in zip(rechecks, found, strict=True) if not exists}
                for i, exists in zip(rechecks, found, strict=True):
                    present[i] = bool(exists)
                read = [i for i in read if i not in absent]
        if read:
            got = self._cache.get_embeddings([asked[i][1].key for i in read])
            if len(got) == len(read):
                for i, tensor in zip(read, got, strict=True):
                    tensors[i] = tensor
        return present, tensors

    def _claim(
        self, asked: list[tuple[str, _Entry]], tensors: list[torch.Tensor | None], present: list[bool]
    ) -> dict[str, Claim]:
        """Claim the items found missing (not those this stager holds, or asked not to claim);
        what each claim answered, by key text."""
        if self._claiming is None:
            return {}
        with self._cond:
            mine = set(self._won)
        wanted: dict[str, EmbeddingKey] = {}
        for (_, entry), tensor, exists in zip(asked, tensors, present, strict=True):
            stored = tensor is not None if self._fetch else exists
            if stored or exists or not entry.claim or entry.text in mine:
                continue  # found, stored but unreadable (encoded here), or not to be claimed
            wanted[entry.text] = entry.key
        if not wanted:
            return {}
        try:
            answers = self._claiming.claim(list(wanted.values()))
        except Exception as exc:  # no claim: encoded here
            self._on_error(f"{len(wanted)} claim(s) raised {type(exc).__name__}: {exc}")
            return {}
        if len(answers) != len(wanted):
            return {}
        return dict(zip(wanted, answers, strict=True))

    def _waits(self, entry: _Entry, tensor: torch.Tensor | None, exists: bool) -> bool:
        """Whether an item asked again while `HELD`, and not claimed, is still waited for."""
        stored = tensor is not None if self._fetch else exists
        return entry.recheck and not entry.claim and not stored and not exists

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
