"""The network of a namespaced test fleet (see `mmkey.testing.fleet`): a private bridge with a
network namespace per holder, joined by veth pairs, and what runs inside those namespaces."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import weakref
from collections.abc import Sequence

import psutil

from mmkey.errors import FleetStartError
from mmkey.testing._process import after_processes_at_exit

_SUBNET_PREFIX = "10.213"
"""Private /24 networks 10.213.X.0/24 for namespaced fleets (X picked free at start)."""
_LIVE_NETS: weakref.WeakSet[_TestNetwork] = weakref.WeakSet()
_NAMES = itertools.count()


def netns_unavailable_reason() -> str | None:
    """Why holders cannot get network namespaces here, or ``None`` when they can.

    Needs Linux, root (CAP_NET_ADMIN) and iproute2's ``ip``; probes by creating and removing
    a namespace.
    """
    if not os.path.isdir("/proc/self/ns") or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run the tests as root to include them"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip` (apt-get install iproute2)"
    probe = f"mmkprobe{os.getpid()}x{next(_NAMES)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _listening_here(pid: int) -> set[tuple[str, int]]:
    """``(address, port)`` of the TCP sockets ``pid`` listens on, in this network namespace."""
    try:
        sockets = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {(s.laddr.ip, s.laddr.port) for s in sockets if s.status == psutil.CONN_LISTEN}


# psutil reads the socket tables of the namespace it runs in: for a holder in a namespace of
# its own, the same reading runs there
_LISTENING_IN_NETNS = """
import json, sys, psutil
sockets = psutil.Process(int(sys.argv[1])).net_connections(kind="tcp")
print(json.dumps([[s.laddr.ip, s.laddr.port] for s in sockets if s.status == "LISTEN"]))
"""


def _listening(pid: int, netns: str | None) -> set[tuple[str, int]]:
    """``(address, port)`` of the TCP sockets ``pid`` listens on in ``netns`` (``None``: this
    process's namespace); empty where they cannot be read."""
    if netns is None:
        return _listening_here(pid)
    inside = ["ip", "netns", "exec", netns, sys.executable, "-I", "-c", _LISTENING_IN_NETNS, str(pid)]
    done = _run(inside, check=False)
    if done.returncode != 0:
        return set()
    return {(str(address), int(port)) for address, port in json.loads(done.stdout)}


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise FleetStartError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done


class _TestNetwork:
    """A private bridge with one network namespace per holder, joined by veth pairs."""

    def __init__(self) -> None:
        token = f"{os.getpid() % 100000:x}{next(_NAMES):x}"
        self.bridge: str = f"mmkb{token}"[:15]
        self._token = token
        self._namespaces: list[str] = []
        self._links: list[str] = []
        self._made_bridge = False
        self.subnet: int = -1
        self.host_address: str = ""
        _LIVE_NETS.add(self)
        try:
            self._make_bridge()
        except BaseException:
            self.close()
            raise

    def _make_bridge(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._made_bridge = True
        start = os.getpid() % 250
        for offset in range(250):
            candidate = (start + offset) % 250 + 1
            if self._subnet_users(candidate):
                continue
            address = f"{_SUBNET_PREFIX}.{candidate}.1"
            _run(["ip", "addr", "add", f"{address}/24", "dev", self.bridge])
            if self._subnet_users(candidate) == {self.bridge}:
                self.subnet, self.host_address = candidate, address
                break
            # another test network took the same subnet at the same moment: move on
            _run(["ip", "addr", "del", f"{address}/24", "dev", self.bridge], check=False)
        else:
            raise FleetStartError(f"no free {_SUBNET_PREFIX}.X.0/24 network for the test bridge")
        _run(["ip", "link", "set", self.bridge, "up"])

    @staticmethod
    def _subnet_users(subnet: int) -> set[str]:
        """Interfaces holding an address in ``10.213.<subnet>.0/24``."""
        prefix = f" inet {_SUBNET_PREFIX}.{subnet}."
        lines = _run(["ip", "-o", "-4", "addr"]).stdout.splitlines()
        return {line.split()[1] for line in lines if prefix in line}

    def add_namespace(self, index: int) -> tuple[str, str, str, str]:
        """A namespace for holder ``index``: ``(netns, host-side link, inner link, address)``."""
        netns = f"mmkn{self._token}h{index}"
        outer = f"mko{self._token}h{index}"[:15]
        inner = f"mki{self._token}h{index}"[:15]
        address = f"{_SUBNET_PREFIX}.{self.subnet}.{10 + index}"
        _run(["ip", "netns", "add", netns])
        self._namespaces.append(netns)
        _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
        self._links.append(outer)
        _run(["ip", "link", "set", inner, "netns", netns])
        _run(["ip", "link", "set", outer, "master", self.bridge, "up"])
        inside = ["ip", "netns", "exec", netns]
        _run([*inside, "ip", "addr", "add", f"{address}/24", "dev", inner])
        _run([*inside, "ip", "link", "set", inner, "up"])
        _run([*inside, "ip", "link", "set", "lo", "up"])
        return netns, outer, inner, address

    def close(self) -> None:
        """Remove every namespace, link and the bridge (idempotent; errors ignored)."""
        for netns in self._namespaces:
            _run(["ip", "netns", "del", netns], check=False)
        for link in self._links:
            _run(["ip", "link", "del", link], check=False)
        if self._made_bridge:
            _run(["ip", "link", "del", self.bridge], check=False)
        self._namespaces, self._links, self._made_bridge = [], [], False
        _LIVE_NETS.discard(self)


def _close_leftover_networks() -> None:
    for network in list(_LIVE_NETS):
        with contextlib.suppress(Exception):
            network.close()


after_processes_at_exit(_close_leftover_networks)  # the holders stop first, while it exists
