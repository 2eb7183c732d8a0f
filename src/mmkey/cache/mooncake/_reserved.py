"""Put sessions of a put-if-absent: what a refused start means, the writes into an opened
session, and the keys a put session of another client reserves while the store does not hold
them.

An honest writer ends or revokes its session within moments; a reservation that outlives
`RESERVED_WAIT_S` is a squat (a client that starts sessions and never writes them, or a
writer that died mid-write), and the writer then upserts its own signed entry over it. This
module remembers when each such key was first seen (a bounded memory, time from an injected
clock), so that a later add of a key waits only for what is left of its wait.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from mmkey.cache.mooncake import Added
from mmkey.cache.mooncake._transport import ALREADY_EXISTS, INVALID_PARAMS
from mmkey.errors import InvalidKey
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

__all__ = [
    "REMEMBERED",
    "RESERVED_WAIT_S",
    "Reservations",
    "fill_sessions",
    "namespaces_of",
    "offsets_of",
    "refused_as",
    "reserved_or_held",
]

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


def offsets_of(sizes: list[int]) -> list[int]:
    """Where each of an entry's buffers lands in the entry: the sizes before it, summed."""
    return list(itertools.accumulate(sizes, initial=0))[:-1]


def refused_as(code: int, stuck: bool) -> Added:
    """What a refused session start means: `Added.RESERVED` where the store holds the key or
    another client reserves it (told apart by `reserved_or_held`), `Added.HELD` where this
    client writes it on another lane, else `Added.FAILED`."""
    if code == ALREADY_EXISTS:
        return Added.RESERVED
    if code == INVALID_PARAMS and not stuck:
        return Added.HELD
    return Added.FAILED


def reserved_or_held(store: MooncakeDistributedStore, keys: list[str]) -> dict[str, Added]:
    """Keys whose session start another client's session or entry refused: `Added.HELD`
    where the store holds the key, `Added.RESERVED` where it does not (a write in progress,
    or a squat), `Added.FAILED` where the master's answer says neither."""
    if not keys:
        return {}
    codes = store.batch_is_exist(keys)
    found = dict(zip(keys, codes, strict=False))
    return {
        key: Added.HELD if found.get(key) == 1 else Added.RESERVED if found.get(key) == 0 else Added.FAILED
        for key in keys
    }


def fill_sessions(
    store: MooncakeDistributedStore,
    keys: list[str],
    ptrs: list[list[int]],
    sizes: list[list[int]],
    totals: list[int],
    stuck: set[str],
) -> set[str]:
    """Send each opened session's buffers and end it; the keys made readable. Every other
    session is revoked, whatever happens, so that no reservation outlives this call; the
    keys whose revoke was refused too are added to `stuck`."""
    ended: set[str] = set()
    try:
        if not keys:
            return ended
        offsets = [offsets_of(run) for run in sizes]
        sent = store.batch_put_from_multi_buffer_ranges(keys, ptrs, sizes, offsets)
        # a range write answers the bytes it wrote; ending a short one would serve whatever
        # the holder's memory held in the rest
        whole = [key for key, n, total in zip(keys, sent, totals, strict=False) if n == total]
        if whole:
            codes = store.batch_put_session_end(whole)
            ended.update(key for key, code in zip(whole, codes, strict=False) if code == 0)
        return ended
    finally:
        unfinished = [key for key in keys if key not in ended]
        if unfinished:
            revoked: list[int] = []
            try:
                revoked = store.batch_put_session_revoke(unfinished)
            finally:
                answered = dict(zip(unfinished, revoked, strict=False))
                stuck.update(key for key in unfinished if answered.get(key, -1) != 0)
