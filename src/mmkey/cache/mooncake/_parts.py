"""What one `MooncakeCache` hands its reads and writes: its transport, configuration,
keyring and counters, and the rate-limited logs of calls answered without the store and of
squatted keys written over."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import attrs

from mmkey._log import Counters, RateLimitedLog
from mmkey.cache.mooncake._transport import StoreTransport
from mmkey.cache.mooncake.config import MooncakeConfig

if TYPE_CHECKING:
    from mmkey.entry.auth import EntryKeyring

__all__ = ["LOG", "LOG_EVERY_S", "CacheParts"]

LOG = logging.getLogger("mmkey.cache.mooncake")
LOG_EVERY_S = 10.0
"""The shortest time between two warnings of one kind."""


def _skips_log() -> RateLimitedLog:
    return RateLimitedLog(
        LOG, logging.WARNING, "Mooncake calls answered as misses without the store: %s%s", period=LOG_EVERY_S
    )


def _squats_log() -> RateLimitedLog:
    return RateLimitedLog(
        LOG,
        logging.WARNING,
        "Mooncake put sessions of another client reserved keys the store did not hold: %s%s",
        period=LOG_EVERY_S,
    )


@attrs.frozen
class CacheParts:
    """The parts of one cache that its facade, reads and writes share."""

    transport: StoreTransport
    config: MooncakeConfig
    keyring: EntryKeyring | None
    counts: Counters
    _skips: RateLimitedLog = attrs.field(init=False, factory=_skips_log)
    _squats: RateLimitedLog = attrs.field(init=False, factory=_squats_log)

    def skipped(self, why: str) -> None:
        """Count (``skipped``) and log (rate-limited) a call answered without the store."""
        self.counts.add(skipped=1)
        self._skips.note(why)

    def squatted(self, count: int, namespaces: list[str], wait: float) -> None:
        """Count (``squatted``) and log (rate-limited) keys written over a reservation that
        outlived its wait."""
        self.counts.add(squatted=count)
        names = ", ".join(repr(name) for name in namespaces)
        self._squats(
            "squat",
            f"{count} key(s) of namespace {names} stayed reserved and unwritten for {wait:g} s "
            "(a client that starts put sessions and never writes them, or a writer that died "
            "mid-write); this cache upserted its own entries over them (counted in "
            "stats().squatted)",
        )
