"""Where the master says a key's replicas are: the transfer endpoints of the in-memory ones."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mooncake.store import ReplicaDescriptor

__all__ = ["memory_endpoints"]


def memory_endpoints(replicas: Sequence[ReplicaDescriptor]) -> list[str]:
    """Transfer endpoints of the in-memory replicas, in the master's order (Mooncake reads
    from the first and does not fail over within a call)."""
    found: list[str] = []
    for replica in replicas:
        with contextlib.suppress(Exception):  # a replica on disk has no memory descriptor
            found.append(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)
    return found
