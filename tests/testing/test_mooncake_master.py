"""The local mooncake_master launcher, its pytest fixture and the small network helpers."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmkey.cache.mooncake import _net
from mmkey.cache.mooncake._net import parse_host_port, port_accepts
from mmkey.testing import mooncake_master as mm
from mmkey.testing.mooncake_master import MasterProcess, MasterStartError, running_master
from mmkey.testing.pytest_plugin import _require_fleet, _require_master
from tests._support import wait_until

SRC = Path(__file__).resolve().parents[2] / "src"


def _proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, ppid) of a live process, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    state, ppid = text[text.rindex(")") + 2 :].split()[:2]
    return comm, state, int(ppid)


def _our_masters() -> set[int]:
    """PIDs of mooncake_master processes (zombies included) whose parent is this process."""
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[0] == "mooncake_master" and stat[2] == os.getpid():
                found.add(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return not Path(f"/proc/{pid}").exists()
    return False


@pytest.fixture(autouse=True)
def _no_new_master_left() -> Iterator[None]:
    before = _our_masters()
    yield
    assert _our_masters() <= before, "a test left a mooncake_master process behind"


@pytest.fixture
def master_runs_here() -> None:
    """Skip (or fail under MMKEY_REQUIRE_MOONCAKE) where no master can run."""
    _require_master()


def _wait_ready(master: MasterProcess, seconds: float = 5.0) -> bool:
    return wait_until(lambda: master.is_ready(timeout=0.5), seconds)


# -- mmkey.cache.mooncake._net -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:50051", ("127.0.0.1", 50051)),
        ("localhost:1", ("localhost", 1)),
        ("master.example:65535", ("master.example", 65535)),
        ("[::1]:50051", ("::1", 50051)),
    ],
)
def test_parse_host_port_accepts(address: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(address) == expected


@pytest.mark.parametrize(
    "address",
    [
        "",
        "127.0.0.1",
        "127.0.0.1:",
        ":50051",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "127.0.0.1:+5",
        "127.0.0.1:5_0",
        "127.0.0.1:５",
        " 127.0.0.1:50051",
        "127.0.0.1:50051\n",
        "::1:50051",
        "[::1]50051",
        "[::1:50051",
        "[::1]x1",
        "[]:50051",
        "a b:1",
    ],
)
def test_parse_host_port_rejects(address: str) -> None:
    with pytest.raises(ValueError, match="invalid address"):
        parse_host_port(address)


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "no port"),
        ("::1:50051", "put an IPv6 host in brackets"),
        (":50051", "empty or malformed host"),
        ("127.0.0.1:x", "port 'x' is not a number"),
        ("127.0.0.1:0", "outside 1..65535"),
    ],
)
def test_a_refused_address_says_what_is_wrong_with_it(address: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_host_port(address)


def test_port_probes() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_accepts("127.0.0.1", port, 1.0)
    assert not port_accepts("127.0.0.1", port, 0.2)
    assert _net.__all__ == [
        "PROGRESS_ENV",
        "bound_stalled_transfers",
        "check_address_field",
        "master_answers",
        "parse_host_port",
        "port_accepts",
    ]


# -- imports stay cheap ------------------------------------------------------------------------
def test_importing_plugin_and_launcher_loads_neither_mooncake_nor_hypothesis() -> None:
    code = (
        "import sys; import mmkey.testing.pytest_plugin, mmkey.testing.mooncake_master;"
        "print(sorted(m for m in ('mooncake', 'mooncake.store', 'hypothesis', 'torch')"
        " if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- availability and skipping -------------------------------------------------------------
def test_unavailable_binary_skips_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mm, "find_master_binary", lambda: None)
    monkeypatch.delenv("MMKEY_REQUIRE_MOONCAKE", raising=False)
    reason = mm.master_unavailable_reason()
    assert reason is not None
    assert "pip install 'mmkey[mooncake-cpu]'" in reason
    assert "libibverbs1" in reason
    assert not mm.master_available()
    with pytest.raises(pytest.skip.Exception, match="mooncake-cpu"):
        _require_master()
    monkeypatch.setenv("MMKEY_REQUIRE_MOONCAKE", "1")
    with pytest.raises(pytest.fail.Exception, match="MMKEY_REQUIRE_MOONCAKE"):
        _require_master()


def test_without_psutil_the_fixtures_skip_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # as if not installed
    monkeypatch.delenv("MMKEY_REQUIRE_MOONCAKE", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"psutil .*pip install 'mmkey\[testing\]'"):
        _require_master()
    with pytest.raises(pytest.skip.Exception, match="psutil"):
        _require_fleet()
    monkeypatch.setenv("MMKEY_REQUIRE_MOONCAKE", "1")
    with pytest.raises(pytest.fail.Exception, match="psutil"):
        _require_master()


def test_unimportable_binding_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # makes the import fail
    reason = mm.master_unavailable_reason()
    assert reason is not None
    assert "binding does not import" in reason


def test_running_master_without_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mm, "find_master_binary", lambda: None)
    with pytest.raises(FileNotFoundError, match="mooncake-cpu"), running_master():
        pass  # pragma: no cover


# -- the launcher against a real master -------------------------------------------------------
@pytest.mark.mooncake
def test_fixture_master_is_ready(mooncake_master: MasterProcess) -> None:
    m = mooncake_master
    assert m.is_running()
    assert m.is_ready()
    assert m.host == "127.0.0.1"
    assert m.address == f"127.0.0.1:{m.rpc_port}"
    assert parse_host_port(m.address) == ("127.0.0.1", m.rpc_port)
    assert m.rpc_port != m.metrics_port
    health = m.health()
    assert health is not None
    assert health["service_ready"] is True
    stat = _proc_stat(m.pid)
    assert stat is not None
    assert stat[0] == "mooncake_master"  # the PID is the master itself, not a wrapper
    assert f"--rpc_port={m.rpc_port}" in m.command
    assert "--rpc_address=127.0.0.1" in m.command
    assert "--metrics_host=127.0.0.1" in m.command
    assert "--enable_metric_reporting=false" in m.command
    assert repr(m) == f"<MasterProcess {m.address} pid={m.pid} running>"


@pytest.mark.mooncake
def test_pause_and_resume(mooncake_master: MasterProcess) -> None:
    m = mooncake_master
    m.pause()
    try:
        assert repr(m).endswith(" paused>")
        stat = _proc_stat(m.pid)
        assert stat is not None
        assert stat[1] == "T"
        assert m.health(timeout=0.3) is None  # frozen: nothing answers
        assert port_accepts("127.0.0.1", m.rpc_port, 0.5)  # yet the kernel still accepts
        assert not m.is_ready(timeout=0.3)
        assert m.is_running()
    finally:
        m.resume()
    assert not m.paused
    assert repr(m).endswith(" running>")
    assert _wait_ready(m)


@pytest.mark.mooncake
def test_restart_keeps_ports(mooncake_master: MasterProcess) -> None:
    m = mooncake_master
    address, rpc, metrics, old = m.address, m.rpc_port, m.metrics_port, m.pid
    started = time.monotonic()
    m.restart()
    elapsed = time.monotonic() - started
    assert (m.address, m.rpc_port, m.metrics_port) == (address, rpc, metrics)
    assert m.pid != old
    assert _gone(old)
    assert m.is_ready()
    assert elapsed < 10.0
    assert m.log_tail(100_000).count("=== start ") == 2


@pytest.mark.mooncake
def test_kill_then_restart(mooncake_master: MasterProcess) -> None:
    m = mooncake_master
    old = m.pid
    m.kill()
    assert not m.is_running()
    assert _gone(old)
    assert not port_accepts("127.0.0.1", m.rpc_port, 0.3)
    assert m.health(timeout=0.3) is None
    assert repr(m).endswith("stopped>")
    with pytest.raises(ProcessLookupError):
        m.pause()
    m.restart()
    assert m.is_ready()
    assert m.pid != old


@pytest.mark.mooncake
def test_restart_a_paused_master(mooncake_master: MasterProcess) -> None:
    m = mooncake_master
    old = m.pid
    m.pause()
    m.restart()
    assert _gone(old)
    assert not m.paused
    assert m.is_ready()


@pytest.mark.mooncake
def test_stop_leaves_no_process_and_no_files(master_runs_here: None) -> None:
    with running_master() as m:
        pid, workdir, rpc = m.pid, m.log_path.parent, m.rpc_port
        assert workdir.is_dir()
        m.pause()  # stopping must work on a frozen master too
    assert _gone(pid)
    assert not workdir.exists()
    assert not port_accepts("127.0.0.1", rpc, 0.3)
    assert not m.is_running()


@pytest.mark.mooncake
def test_retries_when_a_port_is_taken(master_runs_here: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real = mm._two_free_ports
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = [(taken, real()[1])]
        monkeypatch.setattr(mm, "_two_free_ports", lambda host: picks.pop() if picks else real(host))
        with running_master() as m:
            assert m.rpc_port != taken
            assert m.is_ready()
            assert m.log_tail(100_000).count("=== start ") == 2


@pytest.mark.mooncake
def test_failed_start_reports_log_and_cleans_up(master_runs_here: None) -> None:
    with pytest.raises(MasterStartError) as info, running_master(extra_args=["--no_such_flag_for_mmkey=1"]):
        pass  # pragma: no cover
    message = str(info.value)
    assert "no_such_flag_for_mmkey" in message  # the log tail names the cause
    assert "exited during startup" in message


@pytest.mark.mooncake
def test_timeout_stops_the_master(master_runs_here: None) -> None:
    with pytest.raises(MasterStartError, match="not ready in time"), running_master(timeout=0.0):
        pass  # pragma: no cover
