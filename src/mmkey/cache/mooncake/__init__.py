"""The Mooncake store backend: `MooncakeCache` over ``mooncake.store`` and what it needs.

The facade (`MooncakeCache`, in ``_cache``) loads on first use of its name, so importing
this package for `MooncakeConfig` starts no transport thread and registers no exit hook.
Inside: ``_reads`` and ``_writes`` (the facade's read scheduling and write pipelines, over
the ``_parts`` the three share), ``config`` (the frozen configuration and Mooncake's
variables), ``_transport`` (binding calls on worker threads, within a timeout, behind a
breaker), ``_staging`` (registered buffers), ``_quarantine`` and ``_ping`` (unreachable
holders, the master's liveness), ``_replicas`` (where the master says a key is),
``_master_http`` (the master's HTTP endpoints), ``usage`` (the master's metrics), ``holder``
and ``_net`` (holder processes and addresses).

May import: ``mmkey.cache`` (protocol, health, guard), ``mmkey.entry``, ``mmkey.keys``,
``mmkey.digest``, ``mmkey.errors``, ``mmkey._deadline``, ``mmkey._tensors``, ``mmkey._log``; the
binding ``mooncake.store`` only inside functions. Never ``mmkey.encoder``,
``mmkey.integrations``, ``mmkey.testing`` or ``mmkey.cli``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmkey._lazy import lazy_exports
from mmkey.cache.mooncake.config import MooncakeConfig

if TYPE_CHECKING:
    from mmkey.cache.mooncake._added import Added
    from mmkey.cache.mooncake._cache import MooncakeCache

__all__ = ["Added", "MooncakeCache", "MooncakeConfig"]


if not TYPE_CHECKING:
    # hidden from type checkers, so a misspelt name stays a type error; the client (its
    # transport threads and exit hook) loads when first named
    __getattr__, __dir__ = lazy_exports(
        __name__, globals(), {"MooncakeCache": "_cache", "Added": "_added"}, __all__
    )
