"""What a Mooncake master says its store holds, read from its HTTP metrics endpoint.

A client of a remote store cannot know what the store holds (its entries live in the holders'
memory), so `CacheStats.entries` is ``None`` there; the master counts every key and byte of
the whole store, across all clients. `read_master_usage` fetches those counts from the
master's ``/metrics`` (``--metrics_port``, 9003 by default) without importing mooncake.
"""

from __future__ import annotations

import attrs

from mmkey.cache.mooncake import _master_http
from mmkey.cache.mooncake._net import parse_host_port

__all__ = ["StoreUsage", "parse_master_metrics", "read_master_usage"]


@attrs.frozen(slots=True, kw_only=True)
class StoreUsage:
    """The master's own counts for the whole store (every client's entries, not just ours)."""

    keys: int
    """Keys the master indexes."""
    allocated_bytes: int
    """Bytes allocated in the holders' segments."""
    capacity_bytes: int
    """Bytes the mounted segments lend in total."""
    segments: int
    """Mounted segments (holders, and clients that lend memory)."""


def parse_master_metrics(text: str) -> StoreUsage | None:
    """`StoreUsage` from a master's Prometheus text, or ``None`` if the counts are missing."""
    values: dict[str, float] = {}
    segments = 0
    for name, labels, value in _master_http.samples(text):
        if name == "segment_total_capacity_bytes" and labels:
            segments += 1
        elif not labels:
            try:
                values[name] = float(value)
            except ValueError:
                continue
    try:
        return StoreUsage(
            keys=int(values["master_key_count"]),
            allocated_bytes=int(values["master_allocated_bytes"]),
            capacity_bytes=int(values["master_total_capacity_bytes"]),
            segments=segments,
        )
    except KeyError:
        return None


def read_master_usage(metrics_address: str, timeout: float = 1.0) -> StoreUsage | None:
    """The master's counts from ``http://HOST:PORT/metrics``, or ``None`` if it does not answer.

    ``metrics_address`` is ``"host:port"`` of the master's metrics endpoint (``ValueError``
    if malformed); no proxy is used.
    """
    host, port = parse_host_port(metrics_address)
    text = _master_http.read_metrics(host, port, timeout)
    return None if text is None else parse_master_metrics(text)
