"""Addresses and TCP probes: parse and check ``host:port`` text (configs, holder specs,
the master's metrics address) and whether a port accepts a connection (readiness checks of
the test harness). Whether a master answers is ``_ping``'s job: the kernel accepts a TCP
connection for a stopped process too."""

from __future__ import annotations

import socket
from typing import Any

__all__ = ["check_address_field", "parse_host_port", "port_accepts"]


def check_address_field(instance: object, attribute: Any, value: Any) -> None:
    """An attrs validator: the field holds ``"host:port"`` text (errors name the class and field)."""
    field = f"{type(instance).__name__}.{attribute.name}"
    if not isinstance(value, str):
        raise TypeError(f"{field} must be 'host:port' text, got {value!r}")
    try:
        parse_host_port(value)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


def parse_host_port(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6]:port"``) into ``(host, port)``; ``ValueError`` if malformed."""
    expected = "expected 'host:port' such as '127.0.0.1:50051' or '[::1]:50051'"
    if address != address.strip() or not address:
        raise ValueError(f"invalid address {address!r}: {expected}")
    if address.startswith("["):
        end = address.find("]")
        if end < 0 or address[end + 1 : end + 2] != ":":
            raise ValueError(f"invalid address {address!r}: {expected}")
        host, port_text = address[1:end], address[end + 2 :]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise ValueError(f"invalid address {address!r}: no port; {expected}")
        if ":" in host:
            raise ValueError(f"invalid address {address!r}: put an IPv6 host in brackets; {expected}")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"invalid address {address!r}: empty or malformed host; {expected}")
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"invalid address {address!r}: port {port_text!r} is not a number; {expected}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"invalid address {address!r}: port {port} is outside 1..65535")
    return host, port


def port_accepts(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``host:port`` succeeds within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.001)):
            return True
    except OSError:
        return False
