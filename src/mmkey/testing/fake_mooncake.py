"""An in-process stand-in for Mooncake (master, holders and the ``mooncake.store`` client) for
fast, deterministic logic tests; real-master tests stay the reference.

`FakeMooncakeMaster` holds the objects; `FakeMooncakeStore` is a drop-in for the binding's
``MooncakeDistributedStore`` (``stubs/mooncake/store.pyi``): set up against a fake master's
address, it answers every call of the stub with the return codes the real binding returns
(``tests/cache/mooncake/test_mooncake_contract.py`` runs the same assertions against both). The fake master
also answers the liveness request that `MooncakeCache` sends to a master's RPC port, on a
loopback listener, so a cache runs on it unchanged::

    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(master_server_address=master.address)
        with MooncakeCache(config, store_class=FakeMooncakeStore) as cache:
            master.fail_next("batch_is_exist", code=RPC_FAIL)
            ...

Faults are injected, never timed: `FakeMooncakeMaster.fail_next` (the next calls of a method
return a code), `~FakeMooncakeMaster.kill`/`~FakeMooncakeMaster.restart` (every call fails
with `RPC_FAIL`, the objects are lost),
`make_unreachable` (transfers from or to a holder fail with `TRANSFER_FAIL`), `pause_holder`
(transfers from or to a holder block until `resume_holder`, then land, like a holder that was
stopped), `flip_byte` (corrupt a stored value) and `delay` (a method sleeps first). `calls` counts
every call by method name.

Put sessions (``batch_put_session_start`` and the calls that follow it) work as measured on the
binding: a start reserves a key (and its room) for one client, which alone writes ranges into it
and ends it (readable) or revokes it; meanwhile the key is absent to reads, a plain put of it
answers 0 and writes nothing, and every other start answers `OBJECT_ALREADY_EXISTS`. A client
that closes keeps its reservations on the master until ``put_start_discard_timeout_s`` has
passed (the master's ``put_start_discard_timeout_sec``), when the next start of the key
discards them; `FakeMooncakeMaster.reserved` lists the keys reserved. That timeout and the
leases are told by the master's ``clock`` (``FakeMooncakeMaster(clock=...)``, by default the
wall's monotonic clock), so a test can let them run out without sleeping. Bytes a session leaves
unwritten read as `UNWRITTEN_BYTE` once it ends (the real segment leaves whatever its memory
held: zeros when fresh, a freed value's bytes when reused).

What is simplified: objects are placed on the writer's own segment if it has room, else on the
holder with the most free room (the real master places at random); a full store answers
`NO_AVAILABLE_HANDLE` instead of evicting; calls to a dead master fail at once (the real one
takes seconds); transfers go only to and from memory registered with the fake store
(`INVALID_PARAMS` otherwise, where the real binding trusts every pointer).

The master is defined in ``_fake_master``, the client in ``_fake_client`` (set-up, whole
values) and ``_fake_store`` (registered memory, transfers, put sessions); this module is
their public face.
"""

from __future__ import annotations

from mmkey.testing._fake_master import (
    HAS_LEASE,
    ILLEGAL_CLIENT,
    INVALID_PARAMS,
    INVALID_REPLICA,
    NO_AVAILABLE_HANDLE,
    NOT_FOUND,
    OBJECT_ALREADY_EXISTS,
    OK,
    REPLICA_IS_NOT_READY,
    RPC_FAIL,
    TRANSFER_FAIL,
    UNWRITTEN_BYTE,
    FakeDescriptor,
    FakeMemoryDescriptor,
    FakeMooncakeMaster,
    FakeReplicaDescriptor,
    FakeReplicateConfig,
)
from mmkey.testing._fake_store import FakeMooncakeStore

__all__ = [
    "HAS_LEASE",
    "ILLEGAL_CLIENT",
    "INVALID_PARAMS",
    "INVALID_REPLICA",
    "NOT_FOUND",
    "NO_AVAILABLE_HANDLE",
    "OBJECT_ALREADY_EXISTS",
    "OK",
    "REPLICA_IS_NOT_READY",
    "RPC_FAIL",
    "TRANSFER_FAIL",
    "UNWRITTEN_BYTE",
    "FakeDescriptor",
    "FakeMemoryDescriptor",
    "FakeMooncakeMaster",
    "FakeMooncakeStore",
    "FakeReplicaDescriptor",
    "FakeReplicateConfig",
]
