"""A bounded background load like a serving host's, for tests and benchmarks.

`busy_host` runs two child processes: one allocating fresh memory and touching every
page of it (the kernel hands out and zeroes pages all the time, as beside a model server
loading weights), one writing a file and syncing it to disk (as beside a logger or a
checkpoint writer). Each stops by itself after `seconds` or when its parent is gone, and
the context manager enters once both run, and stops both (by PID) and removes the file on
exit.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

__all__ = ["busy_host"]

_START_TIMEOUT_S = 60.0
"""How long a load process may take to start (a fresh interpreter on a loaded host)."""

_MEMORY_LOAD = """
import os, sys, time
end = time.monotonic() + float(sys.argv[1])
size, parent, page = int(sys.argv[2]), os.getppid(), os.sysconf("SC_PAGE_SIZE")
print("up", flush=True)
while time.monotonic() < end and os.getppid() == parent:
    buf = bytearray(size)            # fresh anonymous memory (mmap'd by the allocator)
    buf[::page] = b"\\x01" * len(range(0, size, page))   # one write per page: every page faults in
    del buf                          # unmapped: the next round faults in fresh pages again
"""

_FILE_LOAD = """
import os, sys, time
end = time.monotonic() + float(sys.argv[1])
path, chunk, parent = sys.argv[2], os.urandom(int(sys.argv[3])), os.getppid()
with open(path, "wb") as f:
    print("up", flush=True)
    while time.monotonic() < end and os.getppid() == parent:
        for _ in range(8):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
        f.seek(0)                    # the file never grows past 8 chunks
"""


@contextlib.contextmanager
def busy_host(
    seconds: float = 60.0,
    *,
    memory_bytes: int = 256 << 20,
    write_bytes: int = 1 << 20,
    directory: str | None = None,
) -> Iterator[None]:
    """Load this host for the ``with`` block (at most `seconds`): one process faulting in
    `memory_bytes` of fresh memory over and over, one writing 8 x `write_bytes` to a file
    in `directory` (default: the temp dir) and syncing it, over and over. Enters once both
    run; ``RuntimeError`` if one does not start."""
    with tempfile.TemporaryDirectory(prefix="mmkey-busy-", dir=directory) as tmp:
        load = os.path.join(tmp, "load")
        commands = [
            [sys.executable, "-c", _MEMORY_LOAD, str(seconds), str(memory_bytes)],
            [sys.executable, "-c", _FILE_LOAD, str(seconds), load, str(write_bytes)],
        ]
        procs = [subprocess.Popen(command, stdout=subprocess.PIPE) for command in commands]
        try:
            _wait_started(procs)
            yield
        finally:
            for proc in procs:
                if proc.stdout is not None:
                    proc.stdout.close()
            for proc in procs:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()


def _wait_started(procs: list[subprocess.Popen[bytes]]) -> None:
    """Wait until each load process says it runs (its first line)."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    for proc in procs:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0.0))
        if not readable or not proc.stdout.readline():
            raise RuntimeError(
                f"busy_host: a load process did not start within {_START_TIMEOUT_S:.0f} s "
                f"(exit status {proc.poll()})"
            )
