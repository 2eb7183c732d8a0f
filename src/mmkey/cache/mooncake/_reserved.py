"""Keys a put session of another client reserves while the store does not hold them.

An honest writer ends or revokes its session within moments; a reservation that outlives
`RESERVED_WAIT_S` is a squat (a client that starts sessions and never writes them, or a
writer that died mid-write), and the writer then upserts its own signed entry over it. This
module remembers when each such key was first seen (a bounded memory, time from an injected
clock), so that a later add of a key waits only for what is left of its wait.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from mmkey.errors import InvalidKey
from mmkey.keys import EmbeddingKey

__all__ = ["REMEMBERED", "RESERVED_WAIT_S", "Reservations", "namespaces_of"]

RESERVED_WAIT_S = 1.0
"""How long a reservation of a key the store does not hold is taken for a write in progress."""
REMEMBERED = 4096
"""How many reserved keys a writer remembers (the oldest are forgotten first)."""


class Reservations:
    """When this client first found each reserved, absent key (thread-safe, bounded)."""

    def __init__(self, wait: float, clock: Callable[[], float], *, limit: int = REMEMBERED) -> None:
        self.wait = wait
        self._clock = clock
        self._limit = limit
        self._since: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def due(self, texts: Iterable[str]) -> float:
        """When the wait of every key in `texts` is over (clock time); keys not seen before
        start their wait now."""
        now = self._clock()
        latest = now
        with self._lock:
            for text in texts:
                since = self._since.get(text)
                if since is None:
                    since = self._since[text] = now
                    while len(self._since) > self._limit:
                        self._since.popitem(last=False)
                latest = max(latest, since + self.wait)
        return latest

    def forget(self, texts: Iterable[str]) -> None:
        """Drop keys that are no longer reserved and absent (stored, held, or written over)."""
        with self._lock:
            if self._since:
                for text in texts:
                    self._since.pop(text, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._since)


def namespaces_of(texts: Iterable[str]) -> list[str]:
    """The namespaces of key texts, sorted (a text that is not an mmkey key stands for itself)."""
    found: set[str] = set()
    for text in texts:
        try:
            found.add(EmbeddingKey.from_key(text).namespace)
        except InvalidKey:
            found.add(text)
    return sorted(found)
