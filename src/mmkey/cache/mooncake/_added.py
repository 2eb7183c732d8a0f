"""`Added`: what a put-if-absent (`MooncakeCache.add_from`) did with one key. Its own module,
so that naming it loads no transport (no threads, no exit hook)."""

from __future__ import annotations

import enum

__all__ = ["Added"]


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
