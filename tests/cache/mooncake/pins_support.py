"""What the Mooncake client's pins tests share: the config of a cache on a fake master."""

from __future__ import annotations

from typing import Any

from mmkey import MooncakeConfig
from mmkey.testing.fake_mooncake import FakeMooncakeMaster

MiB = 1 << 20


def fake_config(master: FakeMooncakeMaster, **overrides: Any) -> MooncakeConfig:
    """A client of `master` lending 16 MiB, with a 1 MiB staging buffer, a 2 s timeout and a
    breaker that stays open 30 s (no retry within a test unless it says); `overrides` win."""
    fields: dict[str, Any] = {
        "master_server_address": master.address,
        "global_segment_size": 16 * MiB,
        "local_buffer_size": 1 * MiB,
        "timeout": 2.0,
        "retry_after": 30.0,
    }
    return MooncakeConfig(**{**fields, **overrides})
