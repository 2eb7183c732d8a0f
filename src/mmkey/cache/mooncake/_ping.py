"""Whether a Mooncake master answers right now: one request on its RPC port, bounded in time.

A TCP connect does not show it: the kernel still accepts connections for a process that is
stopped (SIGSTOP) or stuck, and the binding's ``health_check()`` reports the last heartbeat.
The master speaks coro_rpc (yalantinglibs): a request is a 20-byte little-endian header
(magic 21, version 0, serialize type 0, message type 0, sequence number, function id, body
length, attachment length) and every reply starts with a 16-byte header carrying the same
magic and sequence number. A live master answers even a function id it does not know (with
an error code in the reply); a stopped one answers nothing. Measured against
mooncake_master 0.3.13: a reply within a millisecond on loopback, nothing while paused.
"""

from __future__ import annotations

import itertools
import socket
import struct
import time

__all__ = ["master_answers"]

_MAGIC = 21
_REQUEST = struct.Struct("<BBBBIIII")
_REPLY = struct.Struct("<BBBBIII")
_UNKNOWN_FUNCTION = 0xFFFF_FFFF
"""No handler has this id: the master answers with an error code and runs nothing."""
_sequence = itertools.count(1)


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
