"""Against a real local master: what Mooncake's tenants isolate, and authenticated entries."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from mmkey.testing.mooncake_master import MasterProcess

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

pytestmark = pytest.mark.mooncake

MiB = 1 << 20


@pytest.fixture
def tenant_stores(
    mooncake_master_session: MasterProcess,
) -> Iterator[tuple[MooncakeDistributedStore, MooncakeDistributedStore]]:
    """Two raw clients of one master: ``alpha`` holds a segment, ``beta`` is a pure client."""
    from mooncake.store import MooncakeDistributedStore

    stores = []
    try:
        for tenant, segment in (("alpha", 64 * MiB), ("beta", 0)):
            store = MooncakeDistributedStore()
            stores.append(store)
            rc = store.setup(
                "127.0.0.1", "P2PHANDSHAKE", segment, 16 * MiB, "tcp", "",
                mooncake_master_session.address, tenant_id=tenant,
            )
            assert rc == 0
        yield stores[0], stores[1]
    finally:
        for store in stores:
            store.close()


def test_tenants_do_not_isolate_keys(
    tenant_stores: tuple[MooncakeDistributedStore, MooncakeDistributedStore],
) -> None:
    """Measured with the installed binding: another tenant reads, overwrites and removes a key."""
    alpha, beta = tenant_stores
    key = f"tenant-{uuid.uuid4().hex}"
    assert alpha.put(key, b"A" * 1000) == 0
    assert beta.is_exist(key) == 1
    assert beta.get(key) == b"A" * 1000
    assert beta.upsert(key, b"B" * 1000) == 0
    assert alpha.get(key) == b"B" * 1000
    assert beta.remove(key, True) == 0
    assert alpha.is_exist(key) == 0
