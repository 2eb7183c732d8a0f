"""Single-flight claims for `MooncakeCache`: of clients missing one key at once, one encodes.

A claim is a Mooncake put session opened on the key's *lease key* (the entry key's text plus
`LEASE_SUFFIX`, which no mmkey key text can contain, so a lease is never read as an entry) and
never ended. Mooncake grants a session's start to one client; every other client's start answers
``-705`` (`ALREADY_EXISTS`), this client's own second start ``-600`` (`INVALID_PARAMS`). The
winner encodes, writes the entry the normal way and revokes the session (`Claims.release`). A
waiter polls the entry key with ``batch_is_exist`` (a few milliseconds apart, backing off)
until it lands or its bound passes, and then reads it the normal, verified way. Every
`PROBE_EVERY_S` it also asks whether the claims still stand (it starts their lease sessions and
revokes at once what it was granted): a claimant that gave up without writing (its put failed)
frees its waiters then, not at the bound.

Within one cache, callers of one key coalesce without asking the store: a key another caller of
this cache holds or is claiming is `Claim.HELD`, and a release wakes its waiters at once. A
claimant that dies leaves its session reserved until the master discards it
(``put_start_discard_timeout_sec``, 30 s by default); a squatter's sessions never end. Either
costs a waiter at most its bound. A store that does not answer is `Claim.UNCLAIMED`: encode.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmkey._deadline import Done
from mmkey.cache.mooncake._transport import ALREADY_EXISTS, INVALID_PARAMS, RPC_FAILURES, CacheParts
from mmkey.cache.protocol import Claim
from mmkey.errors import StoreError

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

__all__ = [
    "LEASE_BYTES",
    "LEASE_SUFFIX",
    "POLL_FIRST_S",
    "POLL_MAX_S",
    "PROBE_EVERY_S",
    "Claims",
    "lease_key",
]

LEASE_SUFFIX = "#claim"
"""Appended to an entry key's text to make its lease key: ``#`` is in no mmkey key text."""
LEASE_BYTES = 8
"""The room a lease session reserves (it is never written)."""
POLL_FIRST_S = 0.002
"""The first pause between two looks of a waiter at the entries it waits for."""
POLL_MAX_S = 0.01
"""The longest pause between two looks (the pause grows by half each look): a waiter sees
an entry at most this long after it landed, for about 100 lookups a second while it waits."""
PROBE_EVERY_S = 0.05
"""How often a waiter asks whether the claims it waits on still stand: a claim released
without its entry ends the wait for that key at most this long after."""


def lease_key(text: str) -> str:
    """The lease key of the entry key text `text`."""
    return text + LEASE_SUFFIX


class Claims:
    """The claims of one `MooncakeCache`: who encodes a key, and waits for keys others encode.

    ``clock`` (monotonic seconds; by default the transport's) times the waits and
    ``pause(seconds)`` sleeps between looks; by default a pause ends early when a caller of
    this cache releases a claim.
    """

    def __init__(
        self,
        parts: CacheParts,
        *,
        clock: Callable[[], float] | None = None,
        pause: Callable[[float], None] | None = None,
    ) -> None:
        self._parts = parts
        self._clock = parts.transport.clock if clock is None else clock
        self._changed = threading.Condition()
        self._pause = self._until_released if pause is None else pause
        self._mine: set[str] = set()
        """Entry key texts whose lease a caller of this cache holds or is asking for."""

    def claim(self, texts: list[str], give_up: float) -> dict[str, Claim]:
        """Claim each entry key text before encoding it; what each claim answered."""
        with self._changed:
            ask = [text for text in dict.fromkeys(texts) if text not in self._mine]
            self._mine.update(ask)
        answers = dict.fromkeys(texts, Claim.HELD)  # held by another caller of this cache
        try:
            if ask:
                got = self._parts.transport.meta(
                    functools.partial(self._start_on_lane, ask, give_up), give_up
                )
                won = got.value if isinstance(got, Done) else {}
                for text in ask:
                    answers[text] = won.get(text, Claim.UNCLAIMED)
        finally:
            with self._changed:
                self._mine.difference_update(text for text in ask if answers.get(text) is not Claim.WON)
                self._changed.notify_all()
        self._parts.counts.add(claims_won=sum(answers[text] is Claim.WON for text in ask))
        return answers

    def release(self, texts: list[str]) -> None:
        """Revoke the leases this cache won on `texts` (without waiting), waking its waiters."""
        with self._changed:
            mine = [text for text in dict.fromkeys(texts) if text in self._mine]
            self._mine.difference_update(mine)
            self._changed.notify_all()
        if mine:
            leases = [lease_key(text) for text in mine]
            # on the metadata lane, so a later claim of these keys by this cache runs after it
            self._parts.transport.background(lambda store: store.batch_put_session_revoke(leases))

    def wait(self, texts: list[str], bound: float) -> set[str]:
        """Wait at most `bound` seconds for the entries of `texts` to land; those that did.
        Stops early when the store does not answer, and for a key as soon as no client holds
        its claim (whatever has not landed is encoded)."""
        deadline = self._clock() + bound
        pending = list(dict.fromkeys(texts))
        landed: set[str] = set()
        interval = POLL_FIRST_S
        probe_at = self._clock() + PROBE_EVERY_S
        while pending:
            left = deadline - self._clock()
            call_left = min(left, self._parts.config.timeout)
            if call_left <= 0:
                break
            probing = self._clock() >= probe_at
            if probing:
                with self._changed:  # a claim of this cache's own callers is told by its release
                    probed = [text for text in pending if text not in self._mine]
                look = functools.partial(self._probe_on_lane, list(pending), probed)
                probe_at = self._clock() + PROBE_EVERY_S
            else:
                look = functools.partial(self._look_on_lane, list(pending))
            looked = self._parts.transport.meta(look, self._parts.transport.clock() + call_left)
            if not isinstance(looked, Done):
                break
            codes, freed = looked.value
            if not RPC_FAILURES.isdisjoint(codes):
                self._parts.transport.fail()
                break
            landed.update(text for text, code in zip(pending, codes, strict=False) if code == 1)
            pending = [text for text in pending if text not in landed and text not in freed]
            left = deadline - self._clock()
            if not pending or left <= 0:
                break
            self._pause(min(interval, left))
            interval = min(interval * 1.5, POLL_MAX_S)
        return landed

    @staticmethod
    def _look_on_lane(texts: list[str], store: MooncakeDistributedStore) -> tuple[list[int], set[str]]:
        return store.batch_is_exist(texts), set()

    @staticmethod
    def _probe_on_lane(
        texts: list[str], probed: list[str], store: MooncakeDistributedStore
    ) -> tuple[list[int], set[str]]:
        """Which of `probed` no client holds the claim of (their leases granted to this client
        and revoked at once), then whether the entries of `texts` exist: a claimant writes
        before it releases, so an entry whose lease was free is seen landed, not freed."""
        leases = [lease_key(text) for text in probed]
        starts = store.batch_put_session_start(leases, [LEASE_BYTES] * len(leases)) if leases else []
        granted = [lease for lease, code in zip(leases, starts, strict=False) if code == 0]
        codes = store.batch_is_exist(texts)
        if granted:
            store.batch_put_session_revoke(granted)
        freed = {text for text, code in zip(probed, starts, strict=False) if code == 0}
        return codes, freed

    def _until_released(self, seconds: float) -> None:
        with self._changed:
            self._changed.wait(seconds)

    def _start_on_lane(
        self, texts: list[str], give_up: float, store: MooncakeDistributedStore
    ) -> dict[str, Claim]:
        """Open the lease sessions of `texts` (on the metadata lane); what each claim is."""
        leases = [lease_key(text) for text in texts]
        codes = _checked(store.batch_put_session_start(leases, [LEASE_BYTES] * len(leases)), "start")
        # -600: a session of this client that no caller of this cache holds (a revoke that
        # failed, or a start whose caller gave up): revoke it and start again
        stale = [i for i, code in enumerate(codes[: len(texts)]) if code == INVALID_PARAMS]
        if stale:
            store.batch_put_session_revoke([leases[i] for i in stale])
            again = _checked(
                store.batch_put_session_start([leases[i] for i in stale], [LEASE_BYTES] * len(stale)), "start"
            )
            codes = list(codes)
            for i, code in zip(stale, again, strict=False):
                codes[i] = code
        won = [i for i, code in enumerate(codes[: len(texts)]) if code == 0]
        refused = [i for i, code in enumerate(codes[: len(texts)]) if code == ALREADY_EXISTS]
        # a won key whose entry landed since the caller looked needs no encode; a refused lease
        # that exists as an object was written by a squatter: no claimant will ever release it
        looked = [texts[i] for i in won] + [leases[i] for i in refused]
        present = _checked(store.batch_is_exist(looked), "batch_is_exist") if looked else []
        exists = {text for text, code in zip(looked, present, strict=False) if code == 1}
        answers: dict[str, Claim] = {}
        undo: list[str] = []
        now = self._parts.transport.clock()
        for i in won:
            if texts[i] in exists or now >= give_up:  # landed, or nobody waits for it
                undo.append(leases[i])
                answers[texts[i]] = Claim.HELD
            else:
                answers[texts[i]] = Claim.WON
        for i in refused:
            answers[texts[i]] = Claim.UNCLAIMED if leases[i] in exists else Claim.HELD
        if undo:
            store.batch_put_session_revoke(undo)
        return answers


def _checked(codes: list[int], what: str) -> list[int]:
    """`codes`, or `StoreError` when the master did not answer."""
    if not RPC_FAILURES.isdisjoint(codes):
        raise StoreError(f"claims ({what}): master unreachable ({codes[0]})")
    return codes
