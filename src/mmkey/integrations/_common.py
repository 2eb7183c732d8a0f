"""Parts both integrations use: thread-safe counters and a per-kind rate-limited log (both
defined in ``mmkey._log``, shared with the Mooncake client)."""

from __future__ import annotations

from mmkey._log import Counters, RateLimitedLog

__all__ = ["Counters", "RateLimitedLog"]
