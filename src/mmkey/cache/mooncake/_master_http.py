"""The one client of a Mooncake master's HTTP endpoints (``--metrics_port``, 9003 by default):
``/metrics`` (Prometheus text) and ``/health`` (a JSON document).

Requests never go through a proxy (one configured in the environment must not see requests
to a master), are bounded in time and in bytes read, and a master that does not answer, or
answers something unreadable, is ``None``: the callers poll or report, never raise.
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.request
from collections.abc import Iterator

__all__ = ["get", "read_health", "read_metrics", "samples", "segment_names"]

_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.MULTILINE)
_SEGMENT_LABEL = re.compile(r'\{segment="([^"]+)"\}')
_METRICS_LIMIT = 4 << 20
_HEALTH_LIMIT = 64 << 10


def get(host: str, port: int, path: str, *, timeout: float, limit: int) -> bytes | None:
    """At most ``limit`` bytes of ``http://HOST:PORT/PATH``, or ``None`` if it does not answer
    within ``timeout`` seconds (an IPv6 ``host`` is bracketed here)."""
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with _HTTP.open(f"http://{netloc}{path}", timeout=timeout) as response:
            body: bytes = response.read(limit)
    except (OSError, http.client.HTTPException, ValueError):
        return None
    return body


def read_metrics(host: str, port: int, timeout: float = 1.0) -> str | None:
    """The master's ``/metrics`` text, or ``None`` when it does not answer in time."""
    body = get(host, port, "/metrics", timeout=timeout, limit=_METRICS_LIMIT)
    return None if body is None else body.decode("utf-8", "replace")


def read_health(host: str, port: int, timeout: float = 1.0) -> dict[str, object] | None:
    """The master's ``/health`` document, or ``None`` when it does not answer in time."""
    body = get(host, port, "/health", timeout=timeout, limit=_HEALTH_LIMIT)
    if body is None:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def samples(text: str) -> Iterator[tuple[str, str, str]]:
    """``(name, labels, value)`` of each sample line of Prometheus text; ``labels`` is the
    braced label text (``'{segment="h:p"}'``) or ``""``, ``value`` is not parsed."""
    yield from _SAMPLE.findall(text)


def segment_names(text: str) -> set[str]:
    """The segments (``host:port``) that the master's metrics list as mounted."""
    found: set[str] = set()
    for name, labels, _ in samples(text):
        if name == "segment_total_capacity_bytes":
            label = _SEGMENT_LABEL.fullmatch(labels)
            if label:
                found.add(label.group(1))
    return found
