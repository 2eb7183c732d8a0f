"""A short memory of the hashes the store answered yes for (found, stored, or read and
verified), so that `batch_is_exist` of hashes asked again within a second answers without
the hop to the Mooncake client's worker lane.

A remembered yes may be stale (the entry was evicted or removed since): SGLang then asks for
the entry, the read fails (or does not verify) and SGLang treats the hash as a miss and
encodes it, as it does for a yes that the store gave and lost before the read. A yes never
becomes an embedding without a verified read. A no, a failed read or a failed put forgets
the hash at once, and a store fault forgets everything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from itertools import compress
from operator import not_

__all__ = ["RecentlyPresent"]


class RecentlyPresent:
    """Hash texts answered yes within the last `hold_s` seconds (at most `limit` of them).

    Two generations of sets, each half the hold long, so that lookups and updates are single
    C-level set operations: a yes is remembered for at least half the hold and never longer
    than the hold. Over the limit it forgets the older generation, then everything.
    """

    def __init__(self, hold_s: float, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._half = hold_s / 2
        self._limit = limit
        self._clock = clock
        self._young: set[str] = set()
        self._old: set[str] = set()
        self._born = clock()  # when the young generation began
        self._lock = threading.Lock()
        self._closed = False

    def all_present(self, hashes: object) -> bool:
        """Whether `hashes` is a non-empty list whose every item was answered yes recently."""
        if not isinstance(hashes, list) or not hashes:
            return False
        born = self._born  # before the sets: an update renews the sets first, then `_born`
        young, old = self._young, self._old
        age = self._clock() - born
        try:  # C-level set operations: this is the whole cost of a remembered answer
            first = hashes[0]
            if first not in young and first not in old:
                return False  # the usual miss, decided by one item
            if age >= 2 * self._half:
                return False  # both generations are past the hold
            if age >= self._half:
                return young.issuperset(hashes)  # the old generation is past the hold
            return young.issuperset(hashes) or old.issuperset(set(hashes).difference(young))
        except TypeError:  # an unhashable item: the store's path refuses it
            return False

    def note(self, hashes: Sequence[str], answers: Sequence[bool]) -> None:
        """Remember each hash answered yes, forget each answered no (`hashes` as SGLang
        passed them: an item that is not text is never answered yes)."""
        if self._closed:
            return
        with self._lock:
            self._age(self._clock())
            if not all(answers):
                for generation in (self._young, self._old):
                    try:
                        generation.difference_update(compress(hashes, map(not_, answers)))
                    except TypeError:  # an unhashable item (never remembered): forget all
                        generation.clear()
            self._young.update(compress(hashes, answers))
            if len(self._young) + len(self._old) > self._limit:
                self._old = set()
                if len(self._young) > self._limit:
                    self._young = set()

    def clear(self) -> None:
        """Forget every answer (a store fault)."""
        with self._lock:
            self._young, self._old = set(), set()

    def close(self) -> None:
        """Forget every answer and remember none from now on (the store closed)."""
        self._closed = True
        self.clear()

    def __len__(self) -> int:
        return len(self._young | self._old)

    def _age(self, now: float) -> None:
        """Start a new young generation when the current one is half a hold old (with the
        lock held); the old one is forgotten, and both after a whole hold without updates."""
        age = now - self._born
        if age >= self._half:
            self._old = self._young if age < 2 * self._half else set()
            self._young = set()
            self._born = now
