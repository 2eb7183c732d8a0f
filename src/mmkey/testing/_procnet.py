"""Listening TCP sockets and the processes holding them, read from Linux's ``/proc``."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from pathlib import Path

__all__ = ["listening_sockets", "socket_inodes"]


def listening_sockets(net_dir: str = "/proc/net") -> dict[str, tuple[str, int]] | None:
    """``inode -> (address, port)`` of the TCP sockets listening in ``net_dir``'s network
    namespace (``/proc/net`` is the caller's, ``/proc/PID/net`` that of PID), or ``None``
    where neither table is readable."""
    found: dict[str, tuple[str, int]] = {}
    readable = False
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(net_dir, table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A = LISTEN
                continue
            hex_ip, hex_port = fields[1].rsplit(":", 1)
            raw = bytes.fromhex(hex_ip)
            if table == "tcp":
                address = str(ipaddress.IPv4Address(raw[::-1]))
            else:
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                address = str(ipaddress.IPv6Address(words))
            found[fields[9]] = (address, int(hex_port, 16))
    return found if readable else None


def socket_inodes(pid: int) -> set[str] | None:
    """Inodes of the sockets ``pid`` has open, or ``None`` where its descriptors are unreadable."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return None
    inodes: set[str] = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(os.path.join(fd_dir, fd))
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    return inodes
