"""What one `MooncakeCache` hands its reads and writes: its transport, configuration,
keyring and counters, and the rate-limited log of calls answered without the store."""

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


@attrs.frozen
class CacheParts:
    """The parts of one cache that its facade, reads and writes share."""

    transport: StoreTransport
    config: MooncakeConfig
    keyring: EntryKeyring | None
    counts: Counters
    _skips: RateLimitedLog = attrs.field(init=False, factory=_skips_log)

    def skipped(self, why: str) -> None:
        """Count (``skipped``) and log (rate-limited) a call answered without the store."""
        self.counts.add(skipped=1)
        self._skips.note(why)
