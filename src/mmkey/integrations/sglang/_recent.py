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
from itertools import compress, repeat
from operator import not_

__all__ = ["RecentlyPresent"]


class RecentlyPresent:
    """Hash texts answered yes within the last `hold_s` seconds (at most `limit` of them)."""

    def __init__(self, hold_s: float, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._hold = hold_s
        self._limit = limit
        self._clock = clock
        self._until: dict[str, float] = {}  # hash text -> when its yes is forgotten
        self._lock = threading.Lock()
        self._closed = False

    def all_present(self, hashes: object) -> bool:
        """Whether `hashes` is a non-empty list whose every item was answered yes recently."""
        if not isinstance(hashes, list) or not hashes:
            return False
        try:  # C-level loops: this is the whole cost of a remembered answer
            return min(map(self._until.get, hashes, repeat(0.0))) > self._clock()
        except TypeError:  # an unhashable item: the store's path refuses it
            return False

    def note(self, hashes: Sequence[str], answers: Sequence[bool]) -> None:
        """Remember each hash answered yes, forget each answered no (`hashes` as SGLang
        passed them: an item that is not text is never answered yes)."""
        if self._closed:
            return
        now = self._clock()
        with self._lock:
            self._until.update(compress(zip(hashes, repeat(now + self._hold)), answers))
            if self._until and not all(answers):
                for text in compress(hashes, map(not_, answers)):
                    try:
                        self._until.pop(text, None)
                    except TypeError:  # unhashable: never remembered
                        pass
            if len(self._until) > self._limit:
                self._prune(now)

    def clear(self) -> None:
        """Forget every answer (a store fault)."""
        with self._lock:
            self._until.clear()

    def close(self) -> None:
        """Forget every answer and remember none from now on (the store closed)."""
        self._closed = True
        self.clear()

    def __len__(self) -> int:
        return len(self._until)

    def _prune(self, now: float) -> None:
        """Drop expired answers, then the oldest beyond the limit (with the lock held)."""
        self._until = {text: until for text, until in self._until.items() if until > now}
        while len(self._until) > self._limit:
            del self._until[next(iter(self._until))]
