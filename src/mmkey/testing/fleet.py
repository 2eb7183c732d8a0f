"""A local Mooncake fleet for tests: one master plus N segment-holder processes, with faults.

``running_fleet(holders=2)`` starts a ``mooncake_master`` and N holders (Mooncake's standalone
``mooncake_client``, see `mmkey.cache.mooncake.holder`) on free ports, waits until the master lists every
holder's segment, and stops everything by PID on exit, also on failure. Each `HolderProcess`
can be paused (SIGSTOP, a host in a GC pause or swap storm), resumed, killed (SIGKILL) and
restarted. Readers are pure clients (``fleet.client_config()``); `Fleet.holder_of` maps the
transfer endpoint that ``batch_get_replica_desc`` reports to the holder behind it.

With ``netns=True`` (root with ``ip netns``, Linux), each holder runs in a network namespace
of its own with its own address, joined to the test process by a veth pair on a private
bridge; the master listens on the bridge's address. `HolderProcess.partition` takes the
holder's link down, and `HolderProcess.shape` adds latency (``tc netem``, where the kernel
has it) or a rate limit (``tc tbf``). Namespaces, links and the bridge are always removed.
`netns_unavailable_reason()` says why that mode cannot run here (the network itself is
``_test_network``'s).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmkey.cache.mooncake._master_http import read_metrics, segment_names
from mmkey.cache.mooncake._net import port_accepts
from mmkey.cache.mooncake._reads import memory_endpoints
from mmkey.cache.mooncake.holder import HolderSpec, find_holder_binary
from mmkey.errors import FleetStartError, ShapingUnavailable
from mmkey.testing._process import (
    POLL_S,
    ManagedProcess,
    make_workdir,
    remove_workdir,
)
from mmkey.testing._test_network import _listening, _run, _TestNetwork, netns_unavailable_reason
from mmkey.testing.mooncake_master import (
    HOST,
    INSTALL_HINT,
    MasterProcess,
    _free_port,
    running_master,
)

if TYPE_CHECKING:
    from mmkey.cache.mooncake.config import MooncakeConfig

__all__ = [
    "Fleet",
    "FleetStartError",
    "HolderProcess",
    "ShapingUnavailable",
    "fleet_unavailable_reason",
    "netns_unavailable_reason",
    "replica_endpoints",
    "running_fleet",
]

_START_LOCK = threading.Lock()
"""One holder starts at a time: the segment that appears at the master is the starter's."""


def fleet_unavailable_reason() -> str | None:
    """Why a fleet cannot run here (with the install hint), or ``None`` when it can."""
    from mmkey.testing.mooncake_master import master_unavailable_reason

    reason = master_unavailable_reason()
    if reason is not None:
        return reason
    if find_holder_binary() is None:
        return f"no mooncake_client binary was found; {INSTALL_HINT}"
    return None


def _master_segments(master: MasterProcess, timeout: float = 1.0) -> set[str]:
    """Segment names (``host:port``) the master currently lists, from its ``/metrics``."""
    text = read_metrics(master.host, master.metrics_port, timeout)
    return set() if text is None else segment_names(text)


class HolderProcess(ManagedProcess):
    """A mutable handle on one segment-holder process; ``restart()`` keeps its name and address.

    Create it through `running_fleet`. ``pid`` and ``endpoints`` change on restart. `kill` is
    a crash: the holder's entries are gone for everyone.
    """

    def __init__(
        self,
        *,
        name: str,
        master: MasterProcess,
        workdir: Path,
        segment_size: int,
        host: str = HOST,
        netns: str | None = None,
        links: tuple[str, str] | None = None,
        timeout: float = 15.0,
    ) -> None:
        super().__init__(workdir=workdir)
        self._name = name
        self._master = master
        self._segment_size = segment_size
        self._host = host
        self._netns = netns
        self._links = links
        self._timeout = timeout
        self._port = 0
        self._endpoints: frozenset[str] = frozenset()
        self._segment = ""
        self._partitioned = False
        self._shaped = False

    # -- identity -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """``"holder0"``, ``"holder1"``, ...: stable across restarts."""
        return self._name

    @property
    def host(self) -> str:
        """The address the holder listens on (its own in a namespaced fleet)."""
        return self._host

    @property
    def port(self) -> int:
        """The holder's service port of the current start."""
        return self._port

    @property
    def netns(self) -> str | None:
        """The holder's network namespace, or ``None`` on plain loopback."""
        return self._netns

    @property
    def segment(self) -> str:
        """The segment name the master lists for this holder's current start."""
        return self._segment

    @property
    def endpoints(self) -> frozenset[str]:
        """Every ``host:port`` the holder listened on once ready (its transfer endpoint among
        them); kept after a kill, so the keys of a dead holder still map to it."""
        return self._endpoints

    @property
    def log_path(self) -> Path:
        """File receiving the holder's output (all starts, appended)."""
        return self._workdir / f"{self._name}.log"

    @property
    def partitioned(self) -> bool:
        """Whether `partition` cut the holder's link."""
        return self._partitioned

    def __repr__(self) -> str:
        where = f" netns={self._netns}" if self._netns else ""
        return f"<HolderProcess {self._name} {self._host}:{self._port} pid={self.pid} {self._state()}{where}>"

    def spec(self) -> HolderSpec:
        """The `HolderSpec` of the current start."""
        return HolderSpec(
            master_server_address=self._master.address,
            local_hostname=self._host,
            global_segment_size=self._segment_size,
            port=self._port,
        )

    def command(self) -> list[str]:
        """The command line of the current start (inside ``ip netns exec`` when namespaced)."""
        argv = self.spec().argv()
        return ["ip", "netns", "exec", self._netns, *argv] if self._netns else argv

    # -- state ----------------------------------------------------------------------------
    def is_ready(self) -> bool:
        """Running, its service port accepts TCP, and the master lists its segment."""
        proc = self._proc
        if proc is None or proc.poll() is not None or not self._segment:
            return False
        return port_accepts(self._host, self._port, 0.5) and self._segment in _master_segments(self._master)

    # -- faults ---------------------------------------------------------------------------
    def restart(self) -> None:
        """Stop the holder if it runs and start a fresh one (same name and address, new ports)."""
        with self._lock:
            self.stop()
            self.start()

    def partition(self) -> None:
        """Take the holder's link down (namespaced fleets only): it is cut off, yet alive."""
        self._set_link("down")
        self._partitioned = True

    def heal(self) -> None:
        """Bring the holder's link back up after `partition`."""
        self._set_link("up")
        self._partitioned = False

    def shape(self, *, delay_ms: float | None = None, rate_kbit: int | None = None) -> None:
        """Slow the holder's link both ways (namespaced fleets only), replacing earlier shaping.

        ``delay_ms`` adds latency with ``tc netem`` (`ShapingUnavailable` where the kernel lacks
        it); ``rate_kbit`` limits bandwidth with ``tc tbf``. `unshape` removes it.
        """
        if (delay_ms is None) == (rate_kbit is None):
            raise TypeError("shape() takes exactly one of delay_ms= or rate_kbit=")
        outer, inner = self._need_links("shape")
        if delay_ms is not None:
            qdisc = ["netem", "delay", f"{float(delay_ms)}ms"]
        else:
            assert rate_kbit is not None
            burst = max(int(rate_kbit) * 1000 // 8 // 50, 4096)  # ~20 ms of traffic, at least 4 KiB
            qdisc = ["tbf", "rate", f"{int(rate_kbit)}kbit", "burst", str(burst), "latency", "60s"]
        assert self._netns is not None
        for prefix, link in (([], outer), (["ip", "netns", "exec", self._netns], inner)):
            done = _run([*prefix, "tc", "qdisc", "replace", "dev", link, "root", *qdisc], check=False)
            if done.returncode != 0:
                self.unshape()
                message = done.stderr.strip()
                if "unknown" in message.lower():
                    raise ShapingUnavailable(
                        f"tc qdisc {qdisc[0]} is not available in this kernel: {message}"
                    )
                raise FleetStartError(f"tc qdisc {qdisc[0]} on {link} failed: {message}")
        self._shaped = True

    def unshape(self) -> None:
        """Remove what `shape` added (harmless when nothing was)."""
        outer, inner = self._need_links("unshape")
        assert self._netns is not None
        _run(["tc", "qdisc", "del", "dev", outer, "root"], check=False)
        _run(["ip", "netns", "exec", self._netns, "tc", "qdisc", "del", "dev", inner, "root"], check=False)
        self._shaped = False

    # -- internals ------------------------------------------------------------------------
    def _need_links(self, what: str) -> tuple[str, str]:
        if self._links is None or self._netns is None:
            raise RuntimeError(
                f"{what}() needs a holder in a network namespace: use running_fleet(netns=True)"
            )
        return self._links

    def _set_link(self, state: str) -> None:
        outer, _ = self._need_links("partition" if state == "down" else "heal")
        _run(["ip", "link", "set", outer, state])

    def _describe(self) -> str:
        return f"holder {self._name}"

    def _failure(self, what: str) -> str:
        return (
            f"holder {self._name} {what} (command {' '.join(self.command())}); "
            f"log {self.log_path} ends with:\n{self.log_tail()}"
        )

    def start(self) -> None:
        """Start the holder on a free service port and wait until the master lists its segment."""
        with self._lock, _START_LOCK:
            deadline = time.monotonic() + self._timeout
            while True:
                before = _master_segments(self._master)
                # a namespace of its own has every port free; loopback asks the kernel
                self._port = random.randrange(20000, 30000) if self._netns else _free_port(self._host)
                env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
                proc = self._spawn(self.command(), env)
                self._segment = ""
                if self._wait_ready(deadline, before):
                    return
                if proc.poll() is None or time.monotonic() + 0.1 >= deadline:
                    message = self._failure("was not ready in time")
                    self.stop()
                    raise FleetStartError(message)
                # exited early: most likely its port was taken meanwhile; try another one

    def _wait_ready(self, deadline: float, before: set[str]) -> bool:
        """Wait for the service port and for a segment the master did not list before."""
        proc = self._proc
        assert proc is not None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            if port_accepts(self._host, self._port, 0.5):
                new = _master_segments(self._master) - before
                if new:
                    # the segment's name is not one of the holder's sockets: the new name is it
                    self._segment = min(new)
                    listening = _listening(proc.pid, self._netns)
                    self._endpoints = frozenset(
                        f"{self._host if address in ('0.0.0.0', '::') else address}:{port}"
                        for address, port in listening
                    )
                    return True
            time.sleep(POLL_S)
        return False


class Fleet:
    """A master and its holders, from `running_fleet`."""

    def __init__(
        self,
        master: MasterProcess,
        holders: list[HolderProcess],
        *,
        client_host: str,
        network: _TestNetwork | None,
        make_holder: Callable[[int], HolderProcess],
    ) -> None:
        self._master = master
        self._holders = holders
        self._client_host = client_host
        self._network = network
        self._make_holder = make_holder

    @property
    def master(self) -> MasterProcess:
        """The fleet's master (pause, kill and restart it like any `MasterProcess`)."""
        return self._master

    @property
    def holders(self) -> tuple[HolderProcess, ...]:
        """Every holder, in the order they were added."""
        return tuple(self._holders)

    @property
    def namespaced(self) -> bool:
        """Whether each holder has a network namespace (partition and shape work)."""
        return self._network is not None

    @property
    def client_host(self) -> str:
        """The ``local_hostname`` a reader in this process uses to reach the fleet."""
        return self._client_host

    def __repr__(self) -> str:
        return f"<Fleet master={self._master.address} holders={len(self._holders)}>"

    def add_holder(self) -> HolderProcess:
        """Start one more holder and wait until it serves."""
        holder = self._make_holder(len(self._holders))
        self._holders.append(holder)
        holder.start()
        return holder

    def client_config(self, **overrides: Any) -> MooncakeConfig:
        """A `MooncakeConfig` of a pure client (``global_segment_size=0``) of this fleet."""
        from mmkey.cache.mooncake.config import MooncakeConfig

        fields: dict[str, Any] = {
            "master_server_address": self._master.address,
            "local_hostname": self._client_host,
            "global_segment_size": 0,
        }
        fields.update(overrides)
        return MooncakeConfig(**fields)

    def holder_of(self, endpoint: str) -> HolderProcess | None:
        """The holder behind a transfer endpoint (``"host:port"``) or segment name, or ``None``."""
        for holder in self._holders:
            if endpoint in holder.endpoints or endpoint == holder.segment:
                return holder
        return None

    def wait_segments(self, expected: int, timeout: float = 30.0) -> bool:
        """Wait until the master lists exactly ``expected`` segments (it drops a dead holder's
        after its client TTL, 10 s by default); ``False`` if ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(_master_segments(self._master)) == expected:
                return True
            time.sleep(0.1)
        return False

    def segments(self) -> set[str]:
        """Segment names the master lists now."""
        return _master_segments(self._master)


def replica_endpoints(store: object, keys: Sequence[str]) -> dict[str, list[str]]:
    """Transfer endpoints of each key's replicas, as the store reports them (``[]`` if absent).

    ``store`` is a set-up ``mooncake.store.MooncakeDistributedStore``; map the endpoints to
    holders with `Fleet.holder_of`.
    """
    lookup: Any = store
    described: Mapping[str, Sequence[Any]] = lookup.batch_get_replica_desc(list(keys))
    return {key: memory_endpoints(described.get(key, ())) for key in keys}


@contextlib.contextmanager
def running_fleet(
    holders: int = 2,
    *,
    segment_size: int = 64 << 20,
    netns: bool = False,
    timeout: float = 15.0,
    client_ttl: int | None = None,
    master_args: Sequence[str] = (),
) -> Iterator[Fleet]:
    """Run a master and ``holders`` holder processes for the duration of the ``with`` block.

    ``segment_size`` is the memory each holder lends (bytes). ``netns=True`` puts each holder
    in a network namespace of its own (see `netns_unavailable_reason`). ``client_ttl`` is how
    many seconds the master keeps a holder (or client) that stopped answering its pings before
    it drops its segment (``mooncake_master --client_ttl``; ``None``: the master's own 10 s):
    a shorter one shortens tests that wait for a killed holder to be dropped. ``master_args``
    are more of the master's flags (e.g. ``--put_start_discard_timeout_sec=2``). Everything
    started is stopped by PID and every namespace removed on exit, also when the block raises.
    """
    count: object = holders
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise TypeError(f"holders must be a count (int >= 0), got {holders!r}")
    ttl: object = client_ttl
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
        raise TypeError(f"client_ttl must be whole seconds (int >= 1) or None, got {client_ttl!r}")
    reason = fleet_unavailable_reason()
    if reason is not None:
        raise FileNotFoundError(reason)
    if netns:
        why = netns_unavailable_reason()
        if why is not None:
            raise FleetStartError(why)
    workdir = make_workdir("mmkey-fleet-")
    network: _TestNetwork | None = None
    started: list[HolderProcess] = []
    try:
        network = _TestNetwork() if netns else None
        host = network.host_address if network is not None else HOST
        extra_args = (*(() if client_ttl is None else (f"--client_ttl={client_ttl}",)), *master_args)
        with running_master(timeout=timeout, host=host, extra_args=extra_args) as master:

            def make_holder(index: int) -> HolderProcess:
                if network is None:
                    return HolderProcess(
                        name=f"holder{index}",
                        master=master,
                        workdir=workdir,
                        segment_size=segment_size,
                        timeout=timeout,
                    )
                ns, outer, inner, address = network.add_namespace(index)
                return HolderProcess(
                    name=f"holder{index}",
                    master=master,
                    workdir=workdir,
                    segment_size=segment_size,
                    host=address,
                    netns=ns,
                    links=(outer, inner),
                    timeout=timeout,
                )

            fleet = Fleet(master, started, client_host=host, network=network, make_holder=make_holder)
            try:
                for _ in range(holders):
                    fleet.add_holder()
                yield fleet
            finally:
                for holder in started:
                    holder.stop()
                    holder._forget()
    finally:
        if network is not None:
            network.close()
        remove_workdir(workdir)
