"""Bounds on Podium's HTTP connections (the scheduler's port and a node agent's metrics).

aiohttp keeps an idle (or never-speaking) connection open for an hour by default and
accepts any number of them, so a few hundred idle clients used up a scheduler's file
descriptors and new gRPC channels failed (issue #14). A cap on open connections fixed
that, but a client without the token could then fill the cap with connections that never
speak, and ``/healthz`` and ``/readyz`` answered 503 (issue #34). So here:

- at most :data:`HTTP_MAX_CONNECTIONS` connections are open (the descriptor bound);
- a connection that has not sent a byte yet is *silent*: silent ones have their own,
  smaller budget (:data:`HTTP_MAX_PENDING`), and every connection has a shorter deadline
  for its first complete request (:data:`HTTP_FIRST_REQUEST_SECONDS`);
- a new connection over either bound closes the oldest idle one (silent ones first, then
  those between requests or still sending one) instead of being refused, so whoever keeps
  re-opening silent connections only ever pushes out their own older ones, and a probe,
  which sends its request at once, is answered. A newcomer is refused (503) only when
  every open connection is in the middle of being answered;
- a connection idle for :data:`HTTP_IDLE_SECONDS` between requests is closed;
- no path takes a request body: a chunked one, or one over :data:`HTTP_MAX_BODY_BYTES`,
  gets 413 and the connection is closed without reading it (token or not).
"""

from __future__ import annotations

import asyncio
from typing import cast

from aiohttp import web

__all__ = ["HTTP_IDLE_SECONDS", "HTTP_MAX_CONNECTIONS", "HTTP_MAX_PENDING",
           "HTTP_FIRST_REQUEST_SECONDS", "HTTP_MAX_BODY_BYTES", "BoundedRunner"]

#: Seconds a connection may stay open between requests (the dashboard polls every 2 s).
HTTP_IDLE_SECONDS = 10.0
#: Open HTTP connections at most (each is one descriptor).
HTTP_MAX_CONNECTIONS = 128
#: Open connections that have not sent a byte yet, at most.
HTTP_MAX_PENDING = 64
#: Seconds a new connection has to send its first complete request (a probe needs ms).
HTTP_FIRST_REQUEST_SECONDS = 3.0
#: Largest request body let through (no path reads one; this only spares small clients
#: that send an empty form). Larger or chunked bodies: 413 and the connection closed.
HTTP_MAX_BODY_BYTES = 4096

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nContent-Length: 50\r\n\r\n"
         b'{"error": "too many open HTTP connections; retry"}')


class _Refusal(asyncio.Protocol):
    """A connection over the cap while every open one is mid-request: answer 503 and close."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transports write (BaseTransport is what the Protocol declares).
        cast(asyncio.WriteTransport, transport).write(_BUSY)
        transport.close()


class _TrackedHandler(web.RequestHandler):
    """aiohttp's connection handler, telling the book when it connects and closes."""

    def __init__(self, book: _ConnectionBook, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._book = book

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._book.made(self)

    def data_received(self, data: bytes) -> None:
        self._book.spoke(self)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._book.lost(self)
        super().connection_lost(exc)


class _ConnectionBook:
    """Which connections are open, silent, mid-request, in order; who to close for a newcomer."""

    def __init__(self, cap: int, pending_cap: int, first_request_seconds: float) -> None:
        self.cap = cap
        self.pending_cap = pending_cap
        self.first_request_seconds = first_request_seconds
        #: Open connections, least recently active first (insertion order of the dict).
        self.open: dict[_TrackedHandler, None] = {}
        #: Open connections that sent nothing yet, oldest first.
        self.pending: dict[_TrackedHandler, None] = {}
        #: Open connections with no complete request yet: their deadline.
        self.deadlines: dict[_TrackedHandler, asyncio.TimerHandle] = {}
        #: Requests in progress per connection.
        self.busy: dict[_TrackedHandler, int] = {}
        #: Handlers created and admitted whose connection_made has not run yet.
        self.unmade = 0
        #: Connections refused (every open one mid-request) and closed to make room.
        self.refused = 0
        self.evicted = 0

    def admit(self) -> bool:
        """Make room for one more connection; False when none can be made."""
        if len(self.pending) + self.unmade >= self.pending_cap:
            # Silent ones beyond their budget: the oldest goes. Not refusing when none can
            # go yet (all just accepted, in one batch): a probe may be among them.
            self._evict(self.pending)
        if len(self.open) + self.unmade >= self.cap:
            idle = (h for h in self.open if h not in self.busy)
            if not self._evict(self.pending) and not self._evict(idle):
                return False
        self.unmade += 1
        return True

    def _evict(self, candidates) -> bool:
        for handler in candidates:
            if handler.transport is None:
                continue
            was_pending = handler in self.pending
            self.lost(handler)
            if was_pending:
                # It asked nothing yet: a client about to ask reads why it was closed.
                handler.transport.write(_BUSY)
            handler.force_close()  # closes the socket once the 503 is flushed
            self.evicted += 1
            return True
        return False

    def made(self, handler: _TrackedHandler) -> None:
        """A connection of ours is up: silent until its first byte, with a first-request deadline."""
        self.unmade = max(0, self.unmade - 1)
        self.open[handler] = None
        self.pending[handler] = None
        loop = asyncio.get_running_loop()
        self.deadlines[handler] = loop.call_later(self.first_request_seconds, self._expire, handler)

    def spoke(self, handler: _TrackedHandler) -> None:
        """Bytes arrived on ``handler``: no longer silent, and the most recently active."""
        if self.pending.pop(handler, 0) is None and handler in self.open:
            del self.open[handler]
            self.open[handler] = None

    def _expire(self, handler: _TrackedHandler) -> None:
        if self.deadlines.pop(handler, None) is not None:  # no complete request in time
            self.lost(handler)
            handler.force_close()

    def lost(self, handler: _TrackedHandler) -> None:
        """Forget a connection (closed by either side; idempotent)."""
        self.open.pop(handler, None)
        self.busy.pop(handler, None)
        self.pending.pop(handler, None)
        timer = self.deadlines.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def started(self, handler) -> None:
        """A complete request arrived on ``handler``."""
        self.pending.pop(handler, None)
        timer = self.deadlines.pop(handler, None)
        if timer is not None:
            timer.cancel()
        if handler in self.open:
            self.busy[handler] = self.busy.get(handler, 0) + 1

    def finished(self, handler) -> None:
        """That request was answered: the connection is the most recently active."""
        count = self.busy.pop(handler, 0) - 1
        if count > 0:
            self.busy[handler] = count
        if handler in self.open:
            del self.open[handler]
            self.open[handler] = None

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Marks the connection mid-request; refuses request bodies (no path takes one)."""
        protocol = request.protocol
        self.started(protocol)
        try:
            length = request.content_length
            if request.body_exists and (length is None or length > HTTP_MAX_BODY_BYTES):
                reply = web.json_response(
                    {"error": f"request bodies are not accepted (at most {HTTP_MAX_BODY_BYTES} "
                              f"bytes, not chunked)"}, status=413)
                reply.force_close()  # the body is never read: the connection ends after this
                return reply
            return await handler(request)
        finally:
            self.finished(protocol)


class _CappedFactory:
    """The aiohttp server as a protocol factory that makes room or refuses (see the module)."""

    def __init__(self, server: web.Server, book: _ConnectionBook) -> None:
        self._server = server
        self.book = book

    @property
    def refused(self) -> int:
        """Connections refused so far (tests and logs)."""
        return self.book.refused

    @property
    def evicted(self) -> int:
        """Idle connections closed to make room so far."""
        return self.book.evicted

    def __call__(self) -> asyncio.BaseProtocol:
        if not self.book.admit():
            self.book.refused += 1
            return _Refusal()
        server = self._server
        # What web.Server.__call__ builds, as the subclass that reports to the book.
        return _TrackedHandler(self.book, server, loop=server._loop, **server._kwargs)

    def __getattr__(self, name: str):
        return getattr(self._server, name)


class BoundedRunner(web.AppRunner):
    """``web.AppRunner`` with the connection and body bounds of this module."""

    def __init__(self, app: web.Application, *, idle_seconds: float | None = None,
                 max_connections: int | None = None, **kwargs) -> None:
        idle = HTTP_IDLE_SECONDS if idle_seconds is None else idle_seconds
        # lingering_time=0: a body left unread is not drained after the answer (aiohttp
        # reads and drops it for up to 10 s: gigabytes on the event loop); the connection
        # closes instead. read_bufsize: what the parser buffers of a body before pausing.
        super().__init__(app, keepalive_timeout=idle, lingering_time=0,
                         read_bufsize=HTTP_MAX_BODY_BYTES, **kwargs)
        cap = HTTP_MAX_CONNECTIONS if max_connections is None else max_connections
        self.book = _ConnectionBook(cap, min(HTTP_MAX_PENDING, cap), HTTP_FIRST_REQUEST_SECONDS)
        app.middlewares.insert(0, self.book.middleware)

    async def _make_server(self):
        return _CappedFactory(await super()._make_server(), self.book)
