"""A stranger on the network: writes into every buffer a Mooncake process has registered.

Run as ``python registered_memory_writer.py SECONDS PORT...`` against loopback only. For
each port it asks for the segment descriptor with Mooncake's anonymous handshake (an
8-byte little-endian length, a type byte 1 and ``{}``), which lists every registered buffer
(address, length), and then writes a fill byte over each buffer with its own
`TransferEngine`, a chunk at a time, over and over, until SECONDS pass (the handshake is
asked again every round: buffers registered later are found too). Prints one JSON line:
the writes that landed (return code 0), those refused, and the buffers found.
"""

from __future__ import annotations

import importlib
import json
import socket
import struct
import sys
import time
from typing import Any

CHUNK = 64 << 10
FILL = 0x5A
"""The byte the stranger writes: as float32, 1.5e16; easy to tell from real embeddings."""
_DESCRIPTOR = 1


def describe(port: int) -> dict[str, object] | None:
    """The segment descriptor a Mooncake handshake port at `port` on loopback hands out."""
    body = bytes([_DESCRIPTOR]) + b"{}"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(struct.pack("<Q", len(body)) + body)
            head = _exactly(sock, 8)
            (size,) = struct.unpack("<Q", head)
            if size > 1 << 20:
                return None
            reply = _exactly(sock, size)
    except (OSError, struct.error):
        return None
    if reply[:1] != bytes([_DESCRIPTOR]):
        return None
    try:
        found = json.loads(reply[1:])
    except ValueError:
        return None
    return found if isinstance(found, dict) and "buffers" in found else None


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data


def main() -> None:
    seconds = float(sys.argv[1])
    ports = [int(p) for p in sys.argv[2:]]
    engine: Any = importlib.import_module("mooncake.engine").TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("the stranger's transfer engine did not start")
    source = engine.allocate_managed_buffer(CHUNK)
    engine.write_bytes_to_buffer(source, bytes([FILL]) * CHUNK, CHUNK)
    landed = refused = 0
    seen: set[tuple[str, int, int]] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for port in ports:
            descriptor = describe(port)
            if descriptor is None:
                continue
            name = str(descriptor["name"])
            buffers = descriptor["buffers"]
            assert isinstance(buffers, list)
            for buf in buffers:
                addr, length = int(buf["addr"]), int(buf["length"])
                seen.add((name, addr, length))
                for at in range(0, length - CHUNK + 1, CHUNK):
                    if time.monotonic() >= end:
                        break
                    code = engine.transfer_sync_write(name, source, addr + at, CHUNK)
                    if code == 0:
                        landed += 1
                    else:
                        refused += 1
    print(json.dumps({"landed": landed, "refused": refused, "buffers": len(seen)}), flush=True)


if __name__ == "__main__":
    main()
