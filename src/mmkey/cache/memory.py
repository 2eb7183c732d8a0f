"""`MemoryCache`: the embedded default, an in-process LRU of verified entries."""

from __future__ import annotations

import collections
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmkey.cache._guard import insert_args, key_texts
from mmkey.cache.protocol import CacheStats
from mmkey.entry.auth import FROM_ENV, EntryKeyring, FromEnv, keyring_for_cache
from mmkey.entry.codec import encode_entry, verify
from mmkey.errors import CorruptEntry, ForgedEntry, StoreClosed
from mmkey.keys import CacheKey

if TYPE_CHECKING:
    import torch

__all__ = ["MemoryCache"]


class MemoryCache:
    """A thread-safe LRU of encoded entries holding at most `max_bytes` entry bytes.

    Entries are stored encoded (`mmkey.entry.codec`), so every read is verified and a
    tensor mutated after `insert_batch` or after `get_embeddings` never changes what the
    cache holds. An entry larger than the whole budget is refused (``False``). Within one
    batch a repeated key is written in order: the last write wins.

    `keyring` signs every entry and serves only entries whose MAC verifies (see
    `mmkey.entry.auth`); by default it comes from ``MMKEY_ENTRY_KEY_FILE`` /
    ``MMKEY_ENTRY_KEY``, and ``keyring=None`` turns authentication off.
    """

    def __init__(self, max_bytes: int, *, keyring: EntryKeyring | FromEnv | None = FROM_ENV) -> None:
        value: object = max_bytes
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"max_bytes must be an int, got {type(value).__name__}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._max_bytes = max_bytes
        self._keyring = keyring_for_cache(keyring, "MemoryCache")
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._held = 0
        self._closed = False
        self._hits = self._misses = self._inserts = self._evictions = self._corrupt = 0
        self._forged = 0
        self._reasons: collections.Counter[str] = collections.Counter()
        self._unsigned_served = 0

    @property
    def max_bytes(self) -> int:
        """The budget: the most entry bytes (headers and payloads) held at once."""
        return self._max_bytes

    @property
    def keyring(self) -> EntryKeyring | None:
        """The secrets entries are signed and verified with; None when they are not."""
        return self._keyring

    def __repr__(self) -> str:
        auth = "" if self._keyring is None else f", key_id={self._keyring.current.key_id.hex()}"
        return f"MemoryCache(max_bytes={self._max_bytes}, held={self._held}, closed={self._closed}{auth})"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this MemoryCache is closed; create a new one")

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held, in order; does not change recency."""
        self._check_open()
        texts = key_texts(keys, "batch_is_exist")
        with self._lock:
            self._check_open()
            return [text in self._entries for text in texts]

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """A fresh verified tensor per held key, None for a miss; hits become most recent.

        An entry that fails verification is dropped, counted as corrupt (or forged, when
        its MAC fails) and served as a miss.
        """
        self._check_open()
        texts = key_texts(keys, "get_embeddings")
        with self._lock:
            self._check_open()
            found = [self._touch(text) for text in texts]
        results: list[torch.Tensor | None] = []
        corrupt: list[tuple[str, bytes]] = []
        forged = 0
        reasons: collections.Counter[str] = collections.Counter()
        unsigned = 0
        for text, entry in zip(texts, found, strict=True):
            if entry is None:
                results.append(None)
                continue
            try:
                tensor, served_unsigned = verify(text, entry, keyring=self._keyring)
            except CorruptEntry as exc:
                if isinstance(exc, ForgedEntry):
                    forged += 1
                    reasons[exc.reason] += 1
                corrupt.append((text, entry))
                results.append(None)
            else:
                unsigned += served_unsigned
                results.append(tensor)
        hits = sum(result is not None for result in results)
        with self._lock:
            self._hits += hits
            self._misses += len(results) - hits
            self._corrupt += len(corrupt) - forged
            self._forged += forged
            self._reasons.update(reasons)
            self._unsigned_served += unsigned
            for text, entry in corrupt:
                if self._entries.get(text) is entry:
                    self._drop(text)
        return results

    def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        """Store one embedding per key, evicting least recently used entries to fit.

        Returns whether each key is held once the whole batch is written. Rewriting a key
        replaces its entry, and a refused rewrite leaves no older entry behind.
        """
        self._check_open()
        texts, tensors = insert_args(keys, embeddings)
        keyring = self._keyring
        entries = [encode_entry(t, tensor, keyring=keyring) for t, tensor in zip(texts, tensors, strict=True)]
        with self._lock:
            self._check_open()
            for text, entry in zip(texts, entries, strict=True):
                self._put(text, entry)
            return [text in self._entries for text in texts]

    def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """How many of the keys are held; those become most recently used."""
        self._check_open()
        texts = key_texts(keys, "prefetch")
        with self._lock:
            self._check_open()
            return sum(self._touch(text) is not None for text in texts)

    def stats(self) -> CacheStats:
        """A snapshot of the counters; `bytes_held` never exceeds `max_bytes`."""
        with self._lock:
            self._check_open()
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                inserts=self._inserts,
                evictions=self._evictions,
                corrupt=self._corrupt,
                forged=self._forged,
                unsigned=self._reasons["unsigned"],
                unknown_key=self._reasons["unknown_key"],
                expired=self._reasons["expired"],
                bad_mac=self._reasons["bad_mac"],
                unsigned_served=self._unsigned_served,
                bytes_held=self._held,
                entries=len(self._entries),
            )

    def close(self) -> None:
        """Drop every entry; later calls (but `close`) raise `StoreClosed`. Idempotent."""
        with self._lock:
            self._closed = True
            self._entries.clear()
            self._held = 0

    # The helpers below run with the lock held.

    def _touch(self, text: str) -> bytes | None:
        entry = self._entries.get(text)
        if entry is not None:
            self._entries.move_to_end(text)
        return entry

    def _drop(self, text: str) -> None:
        self._held -= len(self._entries.pop(text))

    def _put(self, text: str, entry: bytes) -> None:
        if text in self._entries:
            self._drop(text)
        if len(entry) > self._max_bytes:
            return
        while self._held + len(entry) > self._max_bytes:
            self._held -= len(self._entries.popitem(last=False)[1])
            self._evictions += 1
        self._entries[text] = entry
        self._held += len(entry)
        self._inserts += 1
