"""The same dict-model state machine as the other caches, on MooncakeCache over a real master."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from mmkey import MooncakeCache, MooncakeConfig
from mmkey.testing.cache_model import make_cache_state_machine
from mmkey.testing.mooncake_master import MasterProcess

pytestmark = pytest.mark.mooncake

_master: list[MasterProcess] = []


@pytest.fixture(autouse=True, scope="module")
def _shared_master(mooncake_master_session: MasterProcess) -> Iterator[None]:
    _master.append(mooncake_master_session)
    yield
    _master.clear()


def _cache() -> MooncakeCache:
    return MooncakeCache(
        MooncakeConfig(
            master_server_address=_master[0].address,
            global_segment_size=64 << 20,
            local_buffer_size=16 << 20,
            timeout=5.0,
        )
    )


TestMooncakeCacheModel = make_cache_state_machine(_cache, evicts=False).TestCase
TestMooncakeCacheModel.settings = settings(max_examples=8, stateful_step_count=25)
