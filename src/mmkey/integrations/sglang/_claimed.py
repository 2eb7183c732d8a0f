"""The single-flight claims an SGLang store won at its lookups and has not ended yet.

SGLang asks the store whether an item exists, encodes it when the store says no, and puts it
later; the store never hears that an encode failed or that a request was aborted. So a claim
won at a lookup ends at the put of its hash, or `WonClaims.hold_s` after it was won, whichever
comes first, and at most `WonClaims.limit` are held (beyond that the oldest is released). While
any is held a daemon thread releases those past their time, so none outlives its hold.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping

from mmkey.keys import EmbeddingKey

__all__ = ["WonClaims"]


class WonClaims:
    """Hash text -> the key a lookup claimed for it, each with the time its claim lapses.

    ``release(keys)`` gives claims back (`MooncakeCache.release`: it returns at once);
    ``clock`` (monotonic seconds) times the holds. With ``sweep`` off no thread is started and
    only `expire` (and the puts, the limit, `close`) release claims: for tests that move the clock.
    """

    def __init__(
        self,
        release: Callable[[list[EmbeddingKey]], None],
        hold_s: float,
        limit: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sweep: bool = True,
    ) -> None:
        self._release = release
        self.hold_s = hold_s
        self.limit = limit
        self._clock = clock
        self._sweep = sweep
        self._held: dict[str, tuple[EmbeddingKey, float]] = {}  # oldest first
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, won: Mapping[str, EmbeddingKey]) -> None:
        """Hold the claims just won (hash text -> its key) until their put or their hold."""
        if not won:
            return
        over: list[EmbeddingKey] = []
        with self._changed:
            if self._closed:
                over = list(won.values())
            else:
                lapse = self._clock() + self.hold_s
                for text, key in won.items():
                    self._held.pop(text, None)
                    self._held[text] = (key, lapse)
                while len(self._held) > self.limit:
                    over.append(self._held.pop(next(iter(self._held)))[0])
                if self._sweep and self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="mmkey-sglang-claims", daemon=True)
                    self._thread.start()
                self._changed.notify_all()
        self._give_back(over)

    def end(self, hashes: Iterable[object]) -> None:
        """Release the claims of `hashes` (their put is done, whatever it stored)."""
        with self._changed:
            if not self._held:
                return
            ended = [self._held.pop(text)[0] for text in _texts(hashes) if text in self._held]
        self._give_back(ended)

    def expire(self) -> int:
        """Release the claims past their hold; how many."""
        now = self._clock()
        lapsed: list[EmbeddingKey] = []
        with self._changed:
            while self._held:
                text = next(iter(self._held))
                key, lapse = self._held[text]
                if lapse > now:
                    break
                del self._held[text]
                lapsed.append(key)
        self._give_back(lapsed)
        return len(lapsed)

    def close(self) -> None:
        """Release every claim and hold none from now on; the sweeping thread ends."""
        with self._changed:
            self._closed = True
            held = [key for key, _ in self._held.values()]
            self._held.clear()
            self._changed.notify_all()
        self._give_back(held)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and text in self._held

    def _give_back(self, keys: list[EmbeddingKey]) -> None:
        if keys:
            self._release(keys)

    def _run(self) -> None:
        """Release claims as their holds pass, while any is held."""
        while True:
            with self._changed:
                if self._closed or not self._held:
                    self._thread = None
                    return
                left = next(iter(self._held.values()))[1] - self._clock()
                if left > 0:
                    self._changed.wait(min(left, self.hold_s))
                    continue
            try:
                self.expire()
            except Exception:  # a release that raised: the cache is closed; hold nothing more
                with self._changed:
                    self._held.clear()


def _texts(hashes: Iterable[object]) -> list[str]:
    """The hash texts among `hashes` (SGLang's list; an item that is not text is skipped)."""
    try:
        return [text for text in hashes if isinstance(text, str)]
    except TypeError:
        return []
