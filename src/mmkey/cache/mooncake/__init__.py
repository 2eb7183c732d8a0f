"""The Mooncake store backend: `MooncakeCache` over ``mooncake.store`` and what it needs.

The facade (`MooncakeCache`, in ``_cache``) loads on first use of its name, so importing
this package for `MooncakeConfig` or `Added` starts no transport thread and registers no
exit hook. A read goes ``_cache`` (keys, de-duplication) -> ``_reads`` (which holder, which
transfers, each entry verified by the codec) -> ``mmkey.entry.codec``; a write ``_cache`` ->
``_writes``. Under both, ``_transport`` (binding calls on lanes of ``mmkey._deadline``, each
answering one `Outcome`, behind a breaker; the `CacheParts` reads, writes and ``_claims``
share), ``_staging`` (registered buffers), ``_quarantine`` (unreachable holders),
``_reserved`` (keys other clients reserve), ``config`` (the frozen configuration and
Mooncake's variables), ``_master_http`` (the master's HTTP endpoints), ``usage`` (the
master's metrics), ``holder`` and ``_net`` (holder processes, addresses, the master's
liveness).

May import: ``mmkey.cache`` (protocol, health, guard), ``mmkey.entry``, ``mmkey.keys``,
``mmkey.digest``, ``mmkey.errors``, ``mmkey._deadline``, ``mmkey._tensors``, ``mmkey._log``; the
binding ``mooncake.store`` only inside functions. Never ``mmkey.encoder``,
``mmkey.integrations``, ``mmkey.testing`` or ``mmkey.cli``.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from mmkey._lazy import lazy_exports
from mmkey.cache.mooncake.config import MooncakeConfig

if TYPE_CHECKING:
    from mmkey.cache.mooncake._cache import MooncakeCache

__all__ = ["Added", "MooncakeCache", "MooncakeConfig"]


class Added(enum.Enum):
    """What a put-if-absent (`MooncakeCache.add_from`) did with one key."""

    STORED = "stored"
    """This call wrote the entry: it was the key's first writer."""
    HELD = "held"
    """Nothing written by this call: the store holds the key (another client's write of it
    ended within the wait), or this client is writing it on another of its lanes."""
    RESERVED = "reserved"
    """Nothing written by this call: another client's put session reserves the key, which the
    store does not hold, and the call ended before the wait for that write was over (a later
    add past the wait writes over the reservation: see `MooncakeCache.add_from`)."""
    FAILED = "failed"
    """Not written as far as this call knows: a fault, a full store, or the call's timeout (a
    write handed to the store before the timeout may still complete after it, uncounted)."""


if not TYPE_CHECKING:
    # hidden from type checkers, so a misspelt name stays a type error; the client (its
    # transport threads and exit hook) loads when first named
    __getattr__, __dir__ = lazy_exports(__name__, globals(), {"MooncakeCache": "_cache"}, __all__)
