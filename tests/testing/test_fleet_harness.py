"""The fleet harness of mmkey.testing: a real master and real holder processes, with faults."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmkey.cache.mooncake.holder import HolderSpec
from mmkey.testing.fleet import (
    Fleet,
    FleetStartError,
    HolderProcess,
    ShapingUnavailable,
    netns_unavailable_reason,
    replica_endpoints,
    running_fleet,
)
from mmkey.testing.pytest_plugin import _require_fleet
from tests._support import raw_client, wait_until

pytestmark = pytest.mark.mooncake


def _state(pid: int) -> str | None:
    """The /proc state letter of a live process, or None once it is gone (zombies count as gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state = text[text.rindex(")") + 2]
    return None if state in "ZX" else state


def _flag(holder: HolderProcess, name: str) -> bool:
    """A state flag read afresh (a property that the calls in between changed)."""
    value = getattr(holder, name)
    assert isinstance(value, bool)
    return value


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _netns_names() -> set[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}


def _links() -> set[str]:
    done = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True)
    return {line.split(":")[1].strip().split("@")[0] for line in done.stdout.splitlines()}


@pytest.fixture
def fleet_runs_here() -> None:
    _require_fleet()


@pytest.fixture
def store(mooncake_fleet: Fleet) -> Iterator[object]:
    """A pure client of the fleet on the raw binding."""
    with raw_client(mooncake_fleet.client_config()) as client:
        yield client


def _put_spread(
    store: object, fleet: Fleet, count: int = 40, prefix: str = "fleet-harness", strict: bool = True
) -> dict[str, HolderProcess]:
    """Put `count` new keys through a pure client; where each landed. Unless `strict`, puts
    that fail (placed on a killed holder the master still lists) are left out."""
    from mooncake.store import MooncakeDistributedStore

    assert isinstance(store, MooncakeDistributedStore)
    keys = []
    for key in (f"{prefix}-{i}" for i in range(count)):
        code = store.put(key, key.encode() * 10)
        assert code == 0 or not strict, (key, code)
        if code == 0:
            keys.append(key)
    located: dict[str, HolderProcess] = {}
    for key, endpoints in replica_endpoints(store, keys).items():
        assert len(endpoints) == 1, (key, endpoints)
        holder = fleet.holder_of(endpoints[0])
        assert holder is not None, (endpoints, [h.endpoints for h in fleet.holders])
        located[key] = holder
    return located


def test_starts_holders_that_the_master_lists(mooncake_fleet: Fleet) -> None:
    holders = mooncake_fleet.holders
    assert len(holders) == 2
    assert len({h.pid for h in holders}) == 2
    assert len({h.segment for h in holders}) == 2
    assert mooncake_fleet.segments() == {h.segment for h in holders}
    for holder in holders:
        assert holder.is_running() and holder.is_ready()
        assert _comm(holder.pid) == "mooncake_client"  # the PID is the holder, not a launcher
        assert holder.host == "127.0.0.1" and holder.netns is None
        assert f"127.0.0.1:{holder.port}" in holder.endpoints
    config = mooncake_fleet.client_config()
    assert config.global_segment_size == 0
    assert config.master_server_address == mooncake_fleet.master.address


def test_entries_land_on_holders_and_map_back(mooncake_fleet: Fleet, store: object) -> None:
    from mooncake.store import MooncakeDistributedStore

    assert isinstance(store, MooncakeDistributedStore)
    located = _put_spread(store, mooncake_fleet)
    assert set(located.values()) == set(mooncake_fleet.holders), "both holders should get entries"
    for key in located:
        assert store.get(key) == key.encode() * 10
    assert mooncake_fleet.holder_of("127.0.0.1:1") is None
    assert replica_endpoints(store, ["fleet-harness-absent"]) == {"fleet-harness-absent": []}


def test_pause_resume_kill_restart(mooncake_fleet: Fleet, store: object) -> None:
    from mooncake.store import MooncakeDistributedStore

    assert isinstance(store, MooncakeDistributedStore)
    located = _put_spread(store, mooncake_fleet)
    victim, healthy = mooncake_fleet.holders
    healthy_key = next(k for k, h in located.items() if h is healthy)
    victim_key = next(k for k, h in located.items() if h is victim)

    victim.pause()
    assert _state(victim.pid) == "T" and victim.is_running()
    assert victim.paused
    assert store.get(healthy_key) == healthy_key.encode() * 10  # the other holder still serves
    victim.resume()
    assert _state(victim.pid) in ("S", "R")
    assert not _flag(victim, "paused")
    assert store.get(victim_key) == victim_key.encode() * 10

    old_pid, old_segment = victim.pid, victim.segment
    victim.kill()
    assert _state(old_pid) is None and not victim.is_running()
    assert victim.endpoints, "endpoints stay known after a kill"
    victim.restart()
    assert victim.pid != old_pid and victim.is_ready()
    assert victim.segment != old_segment
    assert victim.segment in mooncake_fleet.segments()
    # Once the master has dropped the killed holder's segment (its client TTL), the restarted
    # holder takes entries again. (Before that, a put placed on the dead segment spins a core
    # inside the binding until its transfer fails.)
    assert mooncake_fleet.wait_segments(2), mooncake_fleet.segments()
    spread = _put_spread(store, mooncake_fleet, 60, prefix="after-restart")
    assert victim in spread.values()
    for key, holder in spread.items():
        if holder is victim:
            assert store.get(key) == key.encode() * 10


def test_add_holder_and_stop(mooncake_fleet: Fleet) -> None:
    third = mooncake_fleet.add_holder()
    assert third.name == "holder2" and third.is_ready()
    assert third.segment in mooncake_fleet.segments()
    pid = third.pid
    third.stop()
    assert _state(pid) is None
    third.stop()  # idempotent


def test_everything_stops_also_when_the_block_raises(fleet_runs_here: None) -> None:
    class Boom(Exception):
        pass

    pids: list[int] = []
    workdir: Path | None = None
    with pytest.raises(Boom), running_fleet(2) as fleet:
        pids = [fleet.master.pid, *(h.pid for h in fleet.holders)]
        fleet.holders[0].pause()  # a paused holder must be stopped too
        workdir = fleet.holders[0].log_path.parent
        raise Boom
    assert pids and all(_state(pid) is None for pid in pids)
    assert workdir is not None and not workdir.exists()


def test_fault_controls_need_a_namespace(mooncake_fleet: Fleet) -> None:
    holder = mooncake_fleet.holders[0]
    assert not mooncake_fleet.namespaced
    with pytest.raises(RuntimeError, match="netns=True"):
        holder.partition()
    with pytest.raises(RuntimeError, match="netns=True"):
        holder.shape(rate_kbit=1000)


def test_bad_arguments(fleet_runs_here: None) -> None:
    with pytest.raises(TypeError, match="holders"), running_fleet(True):
        pass
    with pytest.raises(TypeError, match="holders"), running_fleet(-1):
        pass
    for ttl in (0, 2.5, True, "3"):
        with pytest.raises(TypeError, match="client_ttl"), running_fleet(1, client_ttl=ttl):  # type: ignore[arg-type]
            pass


def test_a_short_client_ttl_drops_a_killed_holder_sooner(fleet_runs_here: None) -> None:
    with running_fleet(2, client_ttl=2) as fleet:
        fleet.holders[0].kill()
        # the master's own TTL is 10 s: gone well before that, the healthy holder kept
        assert fleet.wait_segments(1, timeout=7.0)
        assert fleet.holders[1].segment in fleet.segments()


def test_holder_spec_command_line() -> None:
    spec = HolderSpec(master_server_address="127.0.0.1:50051", global_segment_size=64 << 20, port=50060)
    argv = spec.argv("/opt/mooncake_client")
    assert argv == [
        "/opt/mooncake_client",
        "--host=127.0.0.1",
        "--port=50060",
        "--master_server_address=127.0.0.1:50051",
        "--metadata_server=P2PHANDSHAKE",
        "--global_segment_size=67108864",
        "--protocol=tcp",
    ]
    with_http = HolderSpec(master_server_address="h:1", http_port=9300, device_name="mlx5_0")
    assert with_http.argv("/b")[-3:] == [
        "--device_names=mlx5_0",
        "--enable_http_server=true",
        "--http_port=9300",
    ]
    with pytest.raises(ValueError, match="> 0"):
        HolderSpec(master_server_address="h:1", global_segment_size=0)
    with pytest.raises(TypeError, match="parse_size"):
        HolderSpec(master_server_address="h:1", global_segment_size="1GB")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host:port"):
        HolderSpec(master_server_address="nohostport")
    with pytest.raises(ValueError, match="1..65535"):
        HolderSpec(master_server_address="h:1", port=0)


# -- network namespaces ---------------------------------------------------------------------


def _reachable(holder: HolderProcess, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((holder.host, holder.port), timeout=timeout):
            return True
    except OSError:
        return False


def test_namespaced_fleet_partition_and_heal(mooncake_fleet_netns: Fleet) -> None:
    fleet = mooncake_fleet_netns
    assert fleet.namespaced
    h0, h1 = fleet.holders
    assert h0.host != h1.host and h0.netns and h1.netns and h0.netns != h1.netns
    assert fleet.master.host == fleet.client_host != "127.0.0.1"
    with raw_client(fleet.client_config()) as store:
        located = _put_spread(store, fleet)
        assert set(located.values()) == {h0, h1}
        assert all(endpoint.startswith(h0.host + ":") for endpoint in h0.endpoints)
        h0.partition()
        assert h0.partitioned and h0.is_running()
        assert not _reachable(h0) and _reachable(h1)
        h1_key = next(k for k, h in located.items() if h is h1)
        assert store.get(h1_key) == h1_key.encode() * 10
        h0.heal()
        assert not _flag(h0, "partitioned")
        assert wait_until(lambda: _reachable(h0), 10, poll=0.1)
        h0_key = next(k for k, h in located.items() if h is h0)
        assert store.get(h0_key) == h0_key.encode() * 10


def test_namespaced_fleet_shaping(mooncake_fleet_netns: Fleet) -> None:
    fleet = mooncake_fleet_netns
    h0 = fleet.holders[0]
    with raw_client(fleet.client_config(local_buffer_size=16 << 20)) as store:
        value = os.urandom(256 << 10)
        key = ""
        for i in range(20):  # find a key that lands on h0
            candidate = f"shaped-{i}"
            assert store.put(candidate, value) == 0
            if fleet.holder_of(replica_endpoints(store, [candidate])[candidate][0]) is h0:
                key = candidate
                break
        assert key, "no entry landed on holder0"
        h0.shape(rate_kbit=1024)
        started = time.monotonic()
        assert store.get(key) == value
        # 2 Mbit through a 1 Mbit/s link cannot take less than ~2 s (a physical lower bound)
        assert time.monotonic() - started > 1.0
        h0.unshape()
        with pytest.raises(ShapingUnavailable) if _netem_missing(h0) else contextlib.nullcontext():
            h0.shape(delay_ms=20)
        h0.unshape()
        with pytest.raises(TypeError, match="exactly one"):
            h0.shape()


def _netem_missing(holder: HolderProcess) -> bool:
    assert holder.netns is not None
    probe = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            holder.netns,
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "netem",
            "delay",
            "1ms",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode == 0:
        subprocess.run(["ip", "netns", "exec", holder.netns, "tc", "qdisc", "del", "dev", "lo", "root"])
        return False
    return True


def test_namespaces_are_removed_also_on_failure(fleet_runs_here: None) -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)

    class Boom(Exception):
        pass

    names: set[str] = set()
    links: set[str] = set()
    pids: list[int] = []
    with pytest.raises(Boom), running_fleet(1, netns=True) as fleet:
        holder = fleet.holders[0]
        assert holder.netns is not None
        names = {holder.netns}
        links = {*(holder._links or ())} - {""}
        pids = [fleet.master.pid, holder.pid]
        holder.partition()
        raise Boom
    assert names and not names & _netns_names()
    assert links and not links & _links()
    assert all(_state(pid) is None for pid in pids)


def test_netns_refusal_names_the_reason(monkeypatch: pytest.MonkeyPatch, fleet_runs_here: None) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = netns_unavailable_reason()
    assert reason is not None and "root" in reason
    with pytest.raises(FleetStartError, match="root"), running_fleet(1, netns=True):
        pass


def test_a_holder_that_cannot_join_reports_its_log(fleet_runs_here: None) -> None:
    with running_fleet(0, timeout=3.0) as fleet:
        holder = HolderProcess(
            name="orphan",
            master=fleet.master,
            workdir=fleet.master.log_path.parent,
            segment_size=64 << 20,
            timeout=3.0,
        )
        fleet.master.pause()  # a hung master: the holder cannot mount its segment
        try:
            with pytest.raises(FleetStartError, match="not ready in time") as info:
                holder.start()
        finally:
            fleet.master.resume()
        assert "orphan.log" in str(info.value) and "=== start 1" in str(info.value)
        assert not holder.is_running()


def test_sigterm_of_the_holder_is_graceful(mooncake_fleet: Fleet) -> None:
    holder = mooncake_fleet.holders[1]
    pid = holder.pid
    os.kill(pid, signal.SIGTERM)
    assert wait_until(lambda: not holder.is_running(), 10, poll=0.05)


def test_two_namespaced_fleets_side_by_side(fleet_runs_here: None) -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with running_fleet(1, netns=True) as first, running_fleet(1, netns=True) as second:
        assert first.client_host != second.client_host
        assert first.holders[0].host.rsplit(".", 1)[0] != second.holders[0].host.rsplit(".", 1)[0]
        assert first.holders[0].is_ready() and second.holders[0].is_ready()


# a fleet whose block is never left: only the exit-time clean-up stops it (run here, then
# os._exit, so that nothing else, such as the block's own finally, can do it instead)
_LEFT_OPEN = """
import atexit, os
from mmkey.testing.fleet import running_fleet

block = running_fleet(1, netns=True)
fleet = block.__enter__()
holder = fleet.holders[0]
print(fleet.master.pid, holder.pid, holder.netns, *holder._links, flush=True)
print(fleet.master.log_path.parent, holder.log_path.parent, flush=True)
atexit._run_exitfuncs()
os._exit(0)
"""


def test_a_fleet_left_open_is_stopped_and_its_network_and_folder_removed(fleet_runs_here: None) -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    done = subprocess.run(
        [sys.executable, "-c", _LEFT_OPEN],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, MC_LOG_LEVEL="ERROR"),
    )
    assert done.returncode == 0, done.stderr
    processes, folders = done.stdout.splitlines()
    master_pid, holder_pid, netns, outer, _ = processes.split()
    assert _state(int(master_pid)) is None and _state(int(holder_pid)) is None
    assert netns not in _netns_names()
    assert outer not in _links()
    master_dir, holder_dir = folders.split()
    assert master_dir != holder_dir
    assert not Path(master_dir).exists() and not Path(holder_dir).exists()
