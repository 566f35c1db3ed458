"""Ports a node agent binds and holds until a worker needs them (``ReservePort``), and the
range they come from (:func:`rendezvous_range`, :func:`bind_rendezvous_port`).

A group's first MASTER_PORT is never free: the agent binds it on the node address,
listening, and hands the socket to rank 0's process (:meth:`PortHolds.hand_over`), which
serves torch's store on it (:mod:`podium.worker.masterstore`). A port whose worker is not
named, or whose hold expired, is released just before the worker starts, and torch binds it
seconds later. A port of the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``) can be taken in that gap by any outgoing
connection on the host (the issue-51 ``EADDRINUSE``), so rendezvous ports come from a range
outside it: ``PODIUM_RENDEZVOUS_PORTS=LOW-HIGH`` in the agent's (or worker's) environment,
else :data:`DEFAULT_RANGE` minus the ephemeral range. Only an explicit ``bind`` can take
such a port, never the kernel's choice of a source port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from collections.abc import Mapping

from podium import errors

__all__ = ["BACKLOG", "DEFAULT_RANGE", "PortHolds", "RANGE_ENV", "bind_rendezvous_port", "ephemeral_range",
           "rendezvous_range"]

log = logging.getLogger(__name__)

#: Environment variable naming the rendezvous range, ``LOW-HIGH`` (inclusive).
RANGE_ENV = "PODIUM_RENDEZVOUS_PORTS"
#: The default rendezvous range (inclusive), less any overlap with the ephemeral range.
DEFAULT_RANGE = (20000, 32767)
#: Ports tried at random before giving up (a busy range fails fast with the reason).
_TRIES = 256
#: Connections a held port queues before its store accepts them (ranks that connect
#: before rank 0 has started its store wait there instead of retrying their SYNs).
BACKLOG = 1024
_EPHEMERAL_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range(path: str = _EPHEMERAL_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where the file is missing)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def rendezvous_range(env: Mapping[str, str] | None = None,
                     ephemeral: tuple[int, int] | None = None) -> tuple[int, int]:
    """The range rendezvous ports come from: ``$PODIUM_RENDEZVOUS_PORTS`` (checked: inside
    1024-65535 and outside the ephemeral range), else the part of :data:`DEFAULT_RANGE`
    below the ephemeral range (or above it when none is left below)."""
    given = (os.environ if env is None else env).get(RANGE_ENV, "").strip()
    eph_low, eph_high = ephemeral or ephemeral_range()
    if given:
        try:
            low, high = (int(v) for v in given.split("-"))
        except ValueError:
            raise errors.InvalidArgumentError(f"{RANGE_ENV}={given!r}: expected LOW-HIGH, e.g. 20000-29999") from None
        if not 1024 <= low <= high <= 65535:
            raise errors.InvalidArgumentError(f"{RANGE_ENV}={given!r}: need 1024 <= LOW <= HIGH <= 65535")
        if low <= eph_high and high >= eph_low:
            raise errors.InvalidArgumentError(
                f"{RANGE_ENV}={given!r} overlaps the kernel's ephemeral range {eph_low}-{eph_high} "
                f"({_EPHEMERAL_FILE}): any outgoing connection could take a port of it")
        return low, high
    low, high = DEFAULT_RANGE
    if low < eph_low:
        return low, min(high, eph_low - 1)
    if eph_high < 65535:
        return eph_high + 1, 65535
    raise errors.UnavailableError(
        f"the ephemeral range {eph_low}-{eph_high} leaves no rendezvous ports: set {RANGE_ENV}=LOW-HIGH "
        f"and narrow {_EPHEMERAL_FILE}")


def bind_rendezvous_port(host: str, env: Mapping[str, str] | None = None) -> socket.socket:
    """A listening socket on a free port of :func:`rendezvous_range` on ``host``
    (UnavailableError naming the range when none of the ports tried is free)."""
    low, high = rendezvous_range(env)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    span = high - low + 1
    ports = random.sample(range(low, high + 1), min(span, _TRIES))
    last: OSError | None = None
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(BACKLOG)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise errors.UnavailableError(
        f"cannot bind a rendezvous port on {host}: {len(ports)} ports of {low}-{high} tried, all taken "
        f"({last}); widen {RANGE_ENV}")


class PortHolds:
    """Ports bound and held for a later MASTER_PORT (see ``ReservePort``).

    The held socket listens, so nothing else can bind the port, with or without
    SO_REUSEADDR, until it is handed to the worker that serves it (:meth:`hand_over`) or
    released right before a worker that binds it itself starts. The port is outside the
    ephemeral range (module docstring), so no outgoing connection takes it between the
    release and torch's bind.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        #: The rendezvous range (checked now: a bad ``PODIUM_RENDEZVOUS_PORTS`` stops the agent's start).
        self.range = rendezvous_range()
        self._held: dict[int, tuple[socket.socket, asyncio.TimerHandle]] = {}

    def reserve(self, hold_seconds: float) -> int:
        """Bind a free rendezvous port on the node address and hold it for ``hold_seconds``."""
        sock = bind_rendezvous_port(self.host)
        port = sock.getsockname()[1]
        timer = asyncio.get_running_loop().call_later(hold_seconds, self._expire, port)
        self._held[port] = (sock, timer)
        return port

    def _expire(self, port: int) -> None:
        if self.release(port):
            log.info("port %d: hold expired unclaimed", port)

    def release(self, port: int) -> bool:
        """Close the held socket; False when the port was not held (expired or never)."""
        sock = self.hand_over(port)
        if sock is None:
            return False
        sock.close()
        return True

    def hand_over(self, port: int) -> socket.socket | None:
        """Stop holding ``port`` and return its listening socket (still bound: the caller
        passes it to the worker that serves it, then closes its own copy); None when the
        port was not held (expired or never)."""
        held = self._held.pop(port, None)
        if held is None:
            return None
        sock, timer = held
        timer.cancel()
        return sock

    def held(self) -> list[int]:
        """Ports held right now."""
        return sorted(self._held)

    def close(self) -> None:
        """Release every hold."""
        for port in list(self._held):
            self.release(port)
