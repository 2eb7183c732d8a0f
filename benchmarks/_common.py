"""What the stack benchmarks share: a segment holder for their local master, best-of timing."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

__all__ = ["best", "segment_holder"]


def best(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@contextlib.contextmanager
def segment_holder(master_address: str, size: str) -> Iterator[None]:
    """A standalone ``mooncake_client`` lending ``size`` to the store, stopped by PID on exit."""
    binary = shutil.which("mooncake_client", path=os.path.dirname(sys.executable)) or "mooncake_client"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [
            binary,
            "--host=127.0.0.1",
            f"--global_segment_size={size}",
            "--metadata_server=P2PHANDSHAKE",
            f"--master_server_address={master_address}",
            f"--port={port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(2.0)  # it mounts its segment with the master; the first put checks it
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
