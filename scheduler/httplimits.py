"""Bounds on the scheduler's HTTP connections: an idle timeout and a connection cap.

aiohttp keeps an idle (or never-speaking) connection open for an hour by default and
accepts any number of them, so a few hundred idle clients used up a scheduler's file
descriptors and new gRPC channels failed (issue #14). Here a connection that sends no
complete request for :data:`HTTP_IDLE_SECONDS` is closed (also one that dribbles its
headers), and beyond :data:`HTTP_MAX_CONNECTIONS` open ones a new connection gets a
``503`` and is closed at once, so the scheduler's descriptors stay bounded.
"""

from __future__ import annotations

import asyncio
from typing import cast

from aiohttp import web

__all__ = ["HTTP_IDLE_SECONDS", "HTTP_MAX_CONNECTIONS", "BoundedRunner"]

#: Seconds a connection may go without a complete request (the dashboard polls every 2 s).
HTTP_IDLE_SECONDS = 10.0
#: Open HTTP connections at most; more are answered 503 and closed.
HTTP_MAX_CONNECTIONS = 128

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nContent-Length: 50\r\n\r\n"
         b'{"error": "too many open HTTP connections; retry"}')


class _Refusal(asyncio.Protocol):
    """A connection over the cap: answer 503 and close."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transports write (BaseTransport is what the Protocol declares).
        cast(asyncio.WriteTransport, transport).write(_BUSY)
        transport.close()


class _CappedFactory:
    """The aiohttp server as a protocol factory that refuses connections over the cap."""

    def __init__(self, server: web.Server, cap: int) -> None:
        self._server = server
        self._cap = cap
        #: Connections refused so far (tests and logs).
        self.refused = 0

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self._server.connections) >= self._cap:
            self.refused += 1
            return _Refusal()
        return self._server()

    def __getattr__(self, name: str):
        return getattr(self._server, name)


class BoundedRunner(web.AppRunner):
    """``web.AppRunner`` with an idle timeout and a cap on open connections."""

    def __init__(self, app: web.Application, *, idle_seconds: float | None = None,
                 max_connections: int | None = None, **kwargs) -> None:
        idle = HTTP_IDLE_SECONDS if idle_seconds is None else idle_seconds
        super().__init__(app, keepalive_timeout=idle, **kwargs)
        self._cap = HTTP_MAX_CONNECTIONS if max_connections is None else max_connections

    async def _make_server(self):
        return _CappedFactory(await super()._make_server(), self._cap)
