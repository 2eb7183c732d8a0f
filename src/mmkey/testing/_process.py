"""The lifecycle shared by the test harness's child processes (the master, the holders).

`ManagedProcess` spawns a command with its output appended to a log file, and pauses
(SIGSTOP), resumes, kills and stops it, always reaping; the subclasses add what their
process needs to be ready. Every spawned handle is stopped at interpreter exit, before the
clean-ups registered with `after_processes_at_exit` run and the work folders of
`make_workdir` that their owners left are removed.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

__all__ = [
    "LOG_TAIL_CHARS",
    "POLL_S",
    "STOP_GRACE_S",
    "ManagedProcess",
    "after_processes_at_exit",
    "make_workdir",
    "remove_workdir",
    "wait_stopped",
]

STOP_GRACE_S = 5.0
"""How long `ManagedProcess.stop` waits after SIGTERM before SIGKILL."""
POLL_S = 0.02
"""The readiness poll interval."""
LOG_TAIL_CHARS = 4000
"""How much of a log an error message quotes."""
_LIVE: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()
_AFTER_PROCESSES: list[Callable[[], None]] = []
_WORKDIRS: set[Path] = set()
_STOPPED = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})


def wait_stopped(process: psutil.Process, *, stopped: bool, timeout: float = 2.0) -> None:
    """Wait until ``process`` is stopped (or running again): signals land asynchronously."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = process.status()
        except psutil.Error:
            return  # gone, or not ours to read: nothing to wait for
        if status == psutil.STATUS_ZOMBIE or (status in _STOPPED) == stopped:
            return
        time.sleep(0.001)


def after_processes_at_exit(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` at interpreter exit once every leftover process has been stopped."""
    _AFTER_PROCESSES.append(cleanup)


def make_workdir(prefix: str) -> Path:
    """A new folder for a child's work files, removed at interpreter exit if still there."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _WORKDIRS.add(path)
    return path


def remove_workdir(path: Path) -> None:
    """Remove a folder from `make_workdir` (its processes have been stopped)."""
    _WORKDIRS.discard(path)
    shutil.rmtree(path, ignore_errors=True)


class ManagedProcess:
    """One child process at a time, restartable; subclasses name it and say where it logs."""

    def __init__(self, *, workdir: Path) -> None:
        self._workdir = workdir
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._process: psutil.Process | None = None
        self._starts = 0
        self._paused = False

    # -- what a subclass provides ---------------------------------------------------------
    @property
    def log_path(self) -> Path:
        """File that receives the process's stdout and stderr (all starts, appended)."""
        raise NotImplementedError

    def _describe(self) -> str:
        """How error messages name the process."""
        raise NotImplementedError

    # -- state ----------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        """PID of the current (or last) process (0 before the first start)."""
        proc = self._proc
        return proc.pid if proc is not None else 0

    @property
    def paused(self) -> bool:
        """Whether `pause` stopped the process (SIGSTOP)."""
        return self._paused

    def _state(self) -> str:
        return "paused" if self._paused else ("running" if self.is_running() else "stopped")

    def is_running(self) -> bool:
        """Whether the process exists and has not exited (a paused one counts)."""
        proc = self._proc  # no lock: must not block while another thread restarts
        return proc is not None and proc.poll() is None

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The last ``chars`` characters of the process's log."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-chars:].decode("utf-8", "replace")

    # -- control --------------------------------------------------------------------------
    def pause(self) -> None:
        """Freeze the process with SIGSTOP (returns once it is stopped): it keeps its
        sockets, the kernel still accepts connections, but nothing answers."""
        with self._lock:
            process = self._running("pause")
            process.suspend()
            self._paused = True
            wait_stopped(process, stopped=True)

    def resume(self) -> None:
        """Undo `pause` with SIGCONT (returns once it runs again)."""
        with self._lock:
            process = self._running("resume")
            process.resume()
            self._paused = False
            wait_stopped(process, stopped=False)

    def kill(self) -> None:
        """SIGKILL the process and reap it, like a crash."""
        with self._lock:
            proc = self._proc
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
            self._paused = False

    def stop(self) -> None:
        """Stop gracefully: SIGCONT, SIGTERM, up to 5 s, then SIGKILL; always reaps."""
        with self._lock:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                    if self._process is not None:
                        self._process.resume()
                    proc.terminate()
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    proc.wait()
            elif proc is not None:
                proc.wait()
            self._paused = False

    # -- internals ------------------------------------------------------------------------
    def _running(self, what: str) -> psutil.Process:
        """The current process, which must not have exited (``what`` names the action)."""
        proc, process = self._proc, self._process
        if proc is None or process is None or proc.poll() is not None:
            raise ProcessLookupError(f"cannot {what}: {self._describe()} is not running")
        return process

    def _spawn(self, command: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        """Start ``command`` in the work directory, its output appended to `log_path`."""
        self._starts += 1
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            log.write(f"=== start {self._starts}: {' '.join(command)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=self._workdir,
                close_fds=True,
            )
        self._proc = proc
        self._process = psutil.Process(proc.pid)  # the child is unreaped: its PID is still ours
        self._paused = False
        _LIVE.add(self)
        return proc

    def _forget(self) -> None:
        """Leave the exit-time clean-up (the owner has stopped this process itself)."""
        _LIVE.discard(self)


@atexit.register
def _stop_leftovers() -> None:
    for handle in list(_LIVE):
        with contextlib.suppress(Exception):
            handle.stop()
    for cleanup in _AFTER_PROCESSES:
        with contextlib.suppress(Exception):
            cleanup()
    for path in list(_WORKDIRS):
        remove_workdir(path)
