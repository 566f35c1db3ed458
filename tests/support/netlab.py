"""Hosts on a real network: each in its own network namespace, on one bridge.

A :class:`NetLab` makes a Linux bridge in a namespace of its own (the switch), joins this
namespace to it by a veth pair with an address of its own (the controller, i.e. the test
process, reaches the hosts through it) and, per host, a network namespace joined to the
bridge the same way. A process started on a host with
:meth:`NetLab.popen` runs in that namespace with a private ``/dev/shm``, so Podium sees
remote machines: no loopback shortcut, no shared memory between hosts or with the test.

Faults: :meth:`NetLab.cut` takes a host's link down (a partition: packets are dropped, no
socket is closed, as when a cable or a switch port fails) and :meth:`NetLab.heal` brings it
back; processes are ended by pid by their owners.

Needs root and ``ip netns`` (iproute2); :func:`unavailable` says why when they are missing,
for a skip that names the cause. Names carry this process's pid and a random tag, and
:meth:`NetLab.close` removes every namespace, link and process the lab made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence

__all__ = ["NetLab", "Host", "unavailable"]

#: Where lab subnets are taken from: a /24 of 10.213.0.0/16 not in use on this machine.
POOL = ipaddress.ip_network("10.213.0.0/16")
#: How a host's processes get a /dev/shm of their own (``ip netns exec`` gives each
#: command its own mount namespace, so the tmpfs is seen by that command and its children).
PRIVATE_SHM = 'mount -t tmpfs -o size=4g,mode=1777 podium-lab-shm /dev/shm && exec "$@"'


def _ip(*args: str, netns: str | None = None) -> str:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why a lab cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"pdprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (RuntimeError, OSError) as exc:
        return f"cannot make a network namespace: {exc}"
    return None


class Host:
    """One host of the lab: its namespace, address and the bridge-side end of its link."""

    def __init__(self, name: str, netns: str, address: str, port: str) -> None:
        self.name, self.netns, self.address, self.port = name, netns, address, port

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"


class NetLab:
    """A bridge and hosts in network namespaces (see the module docstring)."""

    def __init__(self) -> None:
        # 9 characters (interface names end with up to two more, within Linux's 15): the pid's
        # last digits and 16 random bits, so the labs of one run (same pid) do not collide.
        self.tag = f"pl{os.getpid() % 1000:03d}{secrets.token_hex(2)}"
        self.subnet = self._free_subnet()
        self._next = 10
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen] = []
        # The bridge sits in a namespace of its own: bridged traffic then meets that
        # namespace's (empty) netfilter, not this machine's, whose FORWARD policy may drop
        # it (a Docker host's does).
        self.switch = f"{self.tag}-sw"
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        self.address = str(self.subnet.network_address + 1)
        self.link = f"{self.tag}c"
        _ip("link", "add", self.link, "type", "veth", "peer", "name", f"{self.tag}cs")
        self._plug(f"{self.tag}cs")
        _ip("addr", "add", f"{self.address}/{self.subnet.prefixlen}", "dev", self.link)
        _ip("link", "set", self.link, "up")

    def _plug(self, port: str) -> None:
        """Move one end of a veth pair into the switch and onto its bridge."""
        _ip("link", "set", port, "netns", self.switch)
        _ip("link", "set", port, "master", "br0", netns=self.switch)
        _ip("link", "set", port, "up", netns=self.switch)

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        used = _ip("-4", "addr")
        subnets = list(POOL.subnets(new_prefix=24))
        random.shuffle(subnets)
        for net in subnets:
            if str(net.network_address)[:-1] not in used:
                return net
        raise RuntimeError(f"no free /24 in {POOL}")

    def add_host(self, name: str) -> Host:
        """A new namespace with one interface on the bridge and its own address."""
        index = len(self.hosts)
        netns = f"{self.tag}-{name}"
        inside, outside = f"{self.tag}h{index}", f"{self.tag}s{index}"
        address = str(self.subnet.network_address + self._next)
        self._next += 1
        _ip("netns", "add", netns)
        host = Host(name, netns, address, outside)
        self.hosts[name] = host
        _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
        _ip("link", "set", inside, "netns", netns)
        self._plug(outside)
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", inside, netns=netns)
        _ip("link", "set", inside, "up", netns=netns)
        return host

    def popen(self, host: Host, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (its namespace, a private /dev/shm); the lab ends it
        at :meth:`close` if its owner has not. The pid is ``argv``'s own (both wrappers exec)."""
        wrapped = ["ip", "netns", "exec", host.netns, "sh", "-c", PRIVATE_SHM, "sh", *argv]
        proc = subprocess.Popen(wrapped, **kwargs)
        self.procs.append(proc)
        return proc

    def cut(self, host: Host) -> None:
        """Partition ``host``: its link goes down, its packets are dropped, sockets stay open."""
        _ip("link", "set", host.port, "down", netns=self.switch)

    def heal(self, host: Host) -> None:
        """Bring ``host``'s link back."""
        _ip("link", "set", host.port, "up", netns=self.switch)

    def close(self) -> None:
        """End the lab's processes (by pid), then remove its namespaces and bridge."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        for host in self.hosts.values():
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", host.netns)  # its veth pair goes with it
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", self.switch)  # the bridge, and the controller's veth pair

    def __enter__(self) -> "NetLab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
