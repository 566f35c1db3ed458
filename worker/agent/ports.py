"""Ports a node agent binds and holds until a worker needs them (``ReservePort``)."""

from __future__ import annotations

import asyncio
import logging
import socket

from podium import errors

__all__ = ["PortHolds"]

log = logging.getLogger(__name__)


class PortHolds:
    """Ports bound and held for a later MASTER_PORT (see ``ReservePort``).

    The held socket listens, so nothing else can bind the port, with or without
    SO_REUSEADDR, until it is released right before the worker that needs it starts.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self._held: dict[int, tuple[socket.socket, asyncio.TimerHandle]] = {}

    def reserve(self, hold_seconds: float) -> int:
        """Bind a free port on the node address and hold it for ``hold_seconds``."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))
            sock.listen(1)
        except OSError as exc:
            sock.close()
            raise errors.UnavailableError(f"cannot bind a port on {self.host}: {exc}") from None
        port = sock.getsockname()[1]
        timer = asyncio.get_running_loop().call_later(hold_seconds, self._expire, port)
        self._held[port] = (sock, timer)
        return port

    def _expire(self, port: int) -> None:
        if self.release(port):
            log.info("port %d: hold expired unclaimed", port)

    def release(self, port: int) -> bool:
        """Close the held socket; False when the port was not held (expired or never)."""
        held = self._held.pop(port, None)
        if held is None:
            return False
        sock, timer = held
        timer.cancel()
        sock.close()
        return True

    def held(self) -> list[int]:
        """Ports held right now."""
        return sorted(self._held)

    def close(self) -> None:
        """Release every hold."""
        for port in list(self._held):
            self.release(port)
