"""Start a real local ``mooncake_master`` on 127.0.0.1 for tests, with fault controls.

``running_master()`` picks free ports, starts the master, waits until it serves and stops it
on exit; the yielded `MasterProcess` can pause, kill and restart it on the same ports. Nothing
here imports mooncake at module import time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from mmkey.cache.mooncake._master_http import read_health
from mmkey.cache.mooncake._net import port_accepts
from mmkey.errors import MasterStartError
from mmkey.testing._process import POLL_S, ManagedProcess, make_workdir, remove_workdir

__all__ = [
    "HOST",
    "INSTALL_HINT",
    "MasterProcess",
    "MasterStartError",
    "find_master_binary",
    "master_available",
    "master_unavailable_reason",
    "running_master",
]

HOST = "127.0.0.1"
"""The only interface the test master listens on."""

_PORT_ATTEMPTS = 5


class _EarlyExit(Exception):
    """The master process exited while we waited for it to become ready."""


def find_master_binary() -> str | None:
    """Path of ``mooncake_master``: next to ``sys.executable`` first, then PATH, then the wheel."""
    here = shutil.which("mooncake_master", path=os.path.dirname(sys.executable))
    if here:
        return here
    on_path = shutil.which("mooncake_master")
    if on_path:
        return on_path
    try:
        spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(folder, "mooncake_master")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


INSTALL_HINT = (
    "pip install 'mmkey[mooncake-cpu]' (or 'mmkey[mooncake]' on NVIDIA machines) and, on "
    "Debian/Ubuntu, apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4"
)
"""How to get the binding and the master binary, for skip and error messages."""


def master_unavailable_reason() -> str | None:
    """Why a local master cannot run here (with the install hint), or ``None`` when it can."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"the Mooncake binding does not import ({exc}); {INSTALL_HINT}"
    if find_master_binary() is None:
        return f"no mooncake_master binary was found; {INSTALL_HINT}"
    return None


def master_available() -> bool:
    """Whether the Mooncake binding imports and a ``mooncake_master`` binary exists."""
    return master_unavailable_reason() is None


def _free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _two_free_ports(host: str = HOST) -> tuple[int, int]:
    first = _free_port(host)
    second = _free_port(host)
    while second == first:
        second = _free_port(host)
    return first, second


def _owns_listener(pid: int, port: int) -> bool:
    """Whether ``pid`` holds a socket listening on ``port`` (``True`` where its sockets are
    not ours to read).

    Guards against a port taken by someone else: that master exits, but for a moment the other
    process answers on the port and would look like ours.
    """
    try:
        sockets = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.AccessDenied:
        return True
    except psutil.NoSuchProcess:
        return False
    return any(s.status == psutil.CONN_LISTEN and s.laddr.port == port for s in sockets)


class MasterProcess(ManagedProcess):
    """A mutable handle on one local master; ``restart()`` keeps its ports and address.

    Create it with `running_master`. ``pid`` is the current process (it changes on restart);
    ``host``, ``rpc_port``, ``metrics_port`` and ``address`` never change. `kill` is a crash:
    every key the master indexed is gone.
    """

    def __init__(
        self,
        *,
        binary: str,
        host: str = HOST,
        rpc_port: int,
        metrics_port: int,
        workdir: Path,
        extra_args: Sequence[str] = (),
        timeout: float = 15.0,
    ) -> None:
        super().__init__(workdir=workdir)
        self._binary = binary
        self._host = host
        self._rpc_port = rpc_port
        self._metrics_port = metrics_port
        self._extra_args = tuple(extra_args)
        self._timeout = timeout

    # -- identity -------------------------------------------------------------------------
    @property
    def rpc_port(self) -> int:
        """The RPC port clients connect to."""
        return self._rpc_port

    @property
    def metrics_port(self) -> int:
        """The HTTP metrics/admin port (``/health``, ``/metrics``)."""
        return self._metrics_port

    @property
    def host(self) -> str:
        """The address the master listens on (``"127.0.0.1"`` unless chosen otherwise)."""
        return self._host

    @property
    def address(self) -> str:
        """``"HOST:RPC_PORT"``, what a store's ``master_server_addr`` takes."""
        return f"{self._host}:{self._rpc_port}"

    @property
    def log_path(self) -> Path:
        """File that receives the master's stdout and stderr (all starts, appended)."""
        return self._workdir / "master.log"

    @property
    def command(self) -> list[str]:
        """The command line each start runs."""
        return [
            self._binary,
            f"--rpc_address={self._host}",
            f"--rpc_port={self._rpc_port}",
            f"--metrics_host={self._host}",
            f"--metrics_port={self._metrics_port}",
            "--enable_metric_reporting=false",
            "--logtostderr=true",
            *self._extra_args,
        ]

    def __repr__(self) -> str:
        return f"<MasterProcess {self.address} pid={self.pid} {self._state()}>"

    # -- state ----------------------------------------------------------------------------
    def health(self, timeout: float = 0.5) -> dict[str, object] | None:
        """The ``/health`` document, or ``None`` if the master does not answer within ``timeout``."""
        return read_health(self._host, self._metrics_port, timeout)

    def is_ready(self, timeout: float = 0.5) -> bool:
        """RPC port accepts TCP and ``/health`` says ``service_ready``, both from this process."""
        proc = self._proc  # no lock: must not block while another thread restarts
        if proc is None or proc.poll() is not None:
            return False
        pid = proc.pid
        if not port_accepts(self._host, self._rpc_port, timeout):
            return False
        doc = read_health(self._host, self._metrics_port, timeout)
        if doc is None or doc.get("service_ready") is not True:
            return False
        return _owns_listener(pid, self._rpc_port) and _owns_listener(pid, self._metrics_port)

    # -- control --------------------------------------------------------------------------
    def restart(self, timeout: float | None = None) -> None:
        """Stop the master if it runs, start a fresh one on the same ports, wait until ready."""
        budget = self._timeout if timeout is None else timeout
        with self._lock:
            self.stop()
            deadline = time.monotonic() + budget
            while True:
                try:
                    self._start_once(deadline)
                    return
                except _EarlyExit:
                    # The old sockets may linger for a moment; the ports are ours, so try again.
                    if time.monotonic() + 0.1 >= deadline:
                        raise MasterStartError(self._failure("exited during restart")) from None
                    time.sleep(0.1)

    # -- internals ------------------------------------------------------------------------
    def _describe(self) -> str:
        return f"mooncake_master at {self.address}"

    def _failure(self, what: str) -> str:
        tail = self.log_tail()
        return (
            f"mooncake_master {what} (rpc {self.address}, metrics port {self._metrics_port}, "
            f"command {' '.join(self.command)}); log {self.log_path} ends with:\n{tail}"
        )

    def _start(self) -> None:
        """One attempt: spawn and wait for readiness within the handle's timeout."""
        with self._lock:
            self._start_once(time.monotonic() + self._timeout)

    def _start_once(self, deadline: float) -> None:
        proc = self._spawn(self.command, dict(os.environ, MC_LOG_LEVEL="ERROR"))
        while True:
            if proc.poll() is not None:
                raise _EarlyExit(proc.returncode)
            if self.is_ready(timeout=0.5):
                return
            if time.monotonic() >= deadline:
                message = self._failure("was not ready in time")
                self.stop()
                raise MasterStartError(message)
            time.sleep(POLL_S)


@contextlib.contextmanager
def running_master(
    *, timeout: float = 15.0, extra_args: Sequence[str] = (), host: str = HOST
) -> Iterator[MasterProcess]:
    """Run a local master on free loopback ports for the duration of the ``with`` block.

    ``extra_args`` are appended to the command line (a later gflag wins). ``host`` is the
    local address it listens on: loopback unless a test network of its own needs another
    (`mmkey.testing.fleet` binds its bridge's address). Raises
    `MasterStartError` when it cannot start, and ``FileNotFoundError`` without a binary.
    """
    binary = find_master_binary()
    if binary is None:
        raise FileNotFoundError(f"mooncake_master not found; {INSTALL_HINT}")
    workdir = make_workdir("mmkey-mooncake-master-")
    handle: MasterProcess | None = None
    try:
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            rpc_port, metrics_port = _two_free_ports(host)
            handle = MasterProcess(
                binary=binary,
                host=host,
                rpc_port=rpc_port,
                metrics_port=metrics_port,
                workdir=workdir,
                extra_args=extra_args,
                timeout=timeout,
            )
            try:
                handle._start()
                break
            except _EarlyExit:
                # Most likely a port picked here was taken before the master bound it.
                if attempt == _PORT_ATTEMPTS:
                    raise MasterStartError(
                        handle._failure(f"exited during startup {attempt} times")
                    ) from None
        assert handle is not None
        yield handle
    finally:
        if handle is not None:
            handle.stop()
            handle._forget()
        remove_workdir(workdir)
