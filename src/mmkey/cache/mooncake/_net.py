"""Addresses and probes: parse and check ``host:port`` text (configs, holder specs, the
master's metrics address), whether a port accepts a connection (readiness checks of the test
harness), and whether a Mooncake master answers right now (`master_answers`).

A TCP connect does not show the last: the kernel still accepts connections for a process
that is stopped (SIGSTOP) or stuck, and the binding's ``health_check()`` reports the last
heartbeat. The master speaks coro_rpc (yalantinglibs): a request is a 20-byte little-endian
header (magic 21, version 0, serialize type 0, message type 0, sequence number, function id,
body length, attachment length) and every reply starts with a 16-byte header carrying the
same magic and sequence number. A live master answers even a function id it does not know
(with an error code in the reply); a stopped one answers nothing. Measured against
mooncake_master 0.3.13: a reply within a millisecond on loopback, nothing while paused.

The binding's TCP transport keeps a core busy for as long as a transfer to a peer that stopped
answering lasts: 30 s by default (its progress deadline, ``MC_TCP_PROGRESS_TIMEOUT_SEC``).
`bound_stalled_transfers` sets that deadline to the store's timeout before set-up.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from typing import Any

__all__ = [
    "PROGRESS_ENV",
    "bound_stalled_transfers",
    "check_address_field",
    "master_answers",
    "parse_host_port",
    "port_accepts",
]

_MAGIC = 21
_REQUEST = struct.Struct("<BBBBIIII")
_REPLY = struct.Struct("<BBBBIII")
_UNKNOWN_FUNCTION = 0xFFFF_FFFF
"""No handler has this id: the master answers with an error code and runs nothing."""
_sequence = itertools.count(1)
PROGRESS_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"
"""How long (whole seconds) the binding's TCP transport lets a transfer go without progress."""


def bound_stalled_transfers(timeout: float) -> None:
    """Unless this process set it, make the binding fail a transfer that made no progress for
    ``timeout`` seconds (rounded up to whole seconds, at least 1) instead of 30 s.

    Measured with 0.3.13 (non-cuda): a read from or a write to a stopped holder keeps one
    client thread at 100% CPU until that deadline; on a host of a few cores that slows every
    other process (a vision tower ran 3x slower). A transfer that moves is never cut by it: the
    deadline restarts on every bit of progress. The binding reads the variable at each transfer,
    so it holds for every Mooncake client of the process.
    """
    os.environ.setdefault(PROGRESS_ENV, str(max(1, math.ceil(timeout))))


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


def master_answers(host: str, port: int, timeout: float) -> bool:
    """Whether the master at `host:port` replies to a coro_rpc request within `timeout` s."""
    give_up = time.monotonic() + max(timeout, 0.001)
    seq = next(_sequence) & 0xFFFF_FFFF
    request = _REQUEST.pack(_MAGIC, 0, 0, 0, seq, _UNKNOWN_FUNCTION, 0, 0)
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.001)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(request)
            reply = b""
            while len(reply) < _REPLY.size:
                left = give_up - time.monotonic()
                if left <= 0:
                    return False
                sock.settimeout(left)
                chunk = sock.recv(_REPLY.size - len(reply))
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    magic, _, _, _, echoed, _, _ = _REPLY.unpack(reply)
    return bool(magic == _MAGIC and echoed == seq)
