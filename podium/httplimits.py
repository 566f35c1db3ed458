"""Bounds on Podium's HTTP servers' connections (the scheduler's port, a node agent's metrics).

aiohttp keeps an idle (or never-speaking) connection open for an hour by default and
accepts any number of them, so a few hundred idle clients used up a scheduler's file
descriptors and new gRPC channels failed (issue #14). A cap on open connections fixed
that, but a client without the token could then fill the cap with connections that never
speak, and ``/healthz`` and ``/readyz`` answered 503 (issue #34). So here:

- at most :data:`HTTP_MAX_CONNECTIONS` connections are open (the descriptor bound);
- a connection that has not sent a byte yet is *silent*: silent ones have their own,
  smaller budget (:data:`HTTP_MAX_SILENT`, :data:`HTTP_MAX_SILENT_PER_PEER` from one peer
  address), and every connection has a short deadline for its first complete request
  (:data:`HTTP_FIRST_REQUEST_SECONDS`);
- over a bound, a newcomer is not refused: an older idle connection of the peer address
  holding the most is closed (its oldest silent one first, else the least recently active
  one between requests). So whoever keeps re-opening silent connections, however fast, only
  pushes out their own, and a probe from another address (the kubelet's is the node's) is
  answered. A newcomer is refused (503) only when every open connection is mid-request;
- a connection idle for :data:`HTTP_IDLE_SECONDS` between requests is closed;
- the listening socket's accept queue (:data:`HTTP_BACKLOG`) is deeper than the flood a
  cap-sized crowd can keep in flight: with aiohttp's 128, 256 connections re-opened as
  fast as they are closed kept it full, the kernel dropped a probe's SYN, and its retry
  came 1 s, then 3 s later (a kubelet probe timed out);
- a request body over its path's bound gets 413 and the connection is closed without
  reading it (token or not), as does a chunked one: the bound is :data:`HTTP_MAX_BODY_BYTES`
  except where the app says otherwise (``body_limit``: the job submission and package upload
  paths), and even there the body is read only by the path's handler, after the token check.

Not covered: probes sent from the attacker's own address, which share its budget; and,
with TLS, connections still in their TLS handshake: asyncio hands a connection to aiohttp
only once its handshake is done, so until then (asyncio's 60 s handshake timeout) it counts
against the cap but cannot be chosen to make room. Under TLS the probes of the Kubernetes
overlay are therefore gRPC health checks (``podium.cli.healthprobe grpc``), which these
connections do not reach: the gRPC server closes a handshake that takes over 5 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from aiohttp import web

__all__ = ["HTTP_BACKLOG", "HTTP_IDLE_SECONDS", "HTTP_MAX_CONNECTIONS", "HTTP_MAX_SILENT",
           "HTTP_MAX_SILENT_PER_PEER",
           "HTTP_FIRST_REQUEST_SECONDS", "HTTP_MAX_BODY_BYTES", "BoundedRunner"]

#: Seconds a connection may stay open between requests (the dashboard polls every 2 s).
HTTP_IDLE_SECONDS = 10.0
#: Open HTTP connections at most (each is one descriptor).
HTTP_MAX_CONNECTIONS = 128
#: Open connections that have not sent a byte yet, at most; and from one peer address.
HTTP_MAX_SILENT = 64
HTTP_MAX_SILENT_PER_PEER = 32
#: The listening socket's accept queue (Linux caps it at net.core.somaxconn, 4096 by default).
HTTP_BACKLOG = 1024
#: Seconds a new connection has to send its first complete request (a probe needs ms).
HTTP_FIRST_REQUEST_SECONDS = 3.0
#: Largest request body let through where the app sets no other bound (those paths read
#: none; this only spares small clients that send an empty form). Larger or chunked bodies:
#: 413 and the connection closed.
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


def _peer(handler: _TrackedHandler) -> str:
    transport = handler.transport
    name = transport.get_extra_info("peername") if transport is not None else None
    return str(name[0]) if isinstance(name, tuple) and name else str(name)


class _ConnectionBook:
    """Which connections are open, silent, mid-request, per peer address, in order; and
    whom to close for a newcomer."""

    def __init__(self, cap: int, silent_cap: int, silent_per_peer: int,
                 first_request_seconds: float, body_limit: Callable[[web.Request], int] | None = None) -> None:
        self.cap = cap
        #: The largest body a request may carry (by its method and path).
        self.body_limit = body_limit or (lambda request: HTTP_MAX_BODY_BYTES)
        self.silent_cap = silent_cap
        self.silent_per_peer = silent_per_peer
        self.first_request_seconds = first_request_seconds
        #: Open connections and their peer address, least recently active first.
        self.open: dict[_TrackedHandler, str] = {}
        #: The same per peer address.
        self.by_peer: dict[str, dict[_TrackedHandler, None]] = {}
        #: Open connections that sent nothing yet, oldest first; the same per peer.
        self.silent: dict[_TrackedHandler, None] = {}
        self.silent_by_peer: dict[str, dict[_TrackedHandler, None]] = {}
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
        """Make room for one more connection under the cap; False when none can be made.

        The newcomer's address is not known yet (its transport comes later), so the peer
        holding the most connections makes room: its oldest silent one goes, else its
        least recently active one between requests."""
        if len(self.open) + self.unmade >= self.cap:
            crowded = sorted(self.by_peer.values(), key=len, reverse=True)
            if not any(self._evict_idle(self.silent_by_peer.get(self.open[next(iter(mine))], {}))
                       or self._evict_idle(mine) for mine in crowded):
                return False
        self.unmade += 1
        return True

    def _evict_idle(self, candidates: dict[_TrackedHandler, None]) -> bool:
        for handler in candidates:
            if handler not in self.busy and handler.transport is not None:
                self._evict(handler)
                return True
        return False

    def _evict(self, handler: _TrackedHandler) -> None:
        transport = handler.transport
        was_silent = handler in self.silent
        self.lost(handler)
        if was_silent and transport is not None:
            # It asked nothing yet: a client about to ask reads why it was closed.
            transport.write(_BUSY)
        handler.force_close()  # closes the socket once the 503 is flushed
        self.evicted += 1

    def made(self, handler: _TrackedHandler) -> None:
        """A connection of ours is up: silent until its first byte, with a first-request
        deadline. Over the silent bounds the oldest silent one of its own peer goes (at the
        per-peer bound), else of the peer holding the most silent ones."""
        self.unmade = max(0, self.unmade - 1)
        peer = _peer(handler)
        mine = self.silent_by_peer.get(peer, {})
        if len(mine) >= self.silent_per_peer:
            self._evict(next(iter(mine)))
        elif len(self.silent) >= self.silent_cap and self.silent_by_peer:
            crowded = max(self.silent_by_peer.values(), key=lambda group: len(group))
            self._evict(next(iter(crowded)))
        self.open[handler] = peer
        self.by_peer.setdefault(peer, {})[handler] = None
        self.silent[handler] = None
        self.silent_by_peer.setdefault(peer, {})[handler] = None
        loop = asyncio.get_running_loop()
        self.deadlines[handler] = loop.call_later(self.first_request_seconds, self._expire, handler)

    def _unsilence(self, handler: _TrackedHandler) -> None:
        if self.silent.pop(handler, 0) is None:
            peer = self.open.get(handler, "")
            mine = self.silent_by_peer.get(peer, {})
            mine.pop(handler, None)
            if not mine:
                self.silent_by_peer.pop(peer, None)

    def _touch(self, handler: _TrackedHandler) -> None:
        """``handler`` is the most recently active connection (of all, and of its peer)."""
        peer = self.open.pop(handler, None)
        if peer is not None:
            self.open[handler] = peer
            mine = self.by_peer[peer]
            del mine[handler]
            mine[handler] = None

    def spoke(self, handler: _TrackedHandler) -> None:
        """Bytes arrived on ``handler``: no longer silent."""
        if handler in self.silent:
            self._unsilence(handler)
            self._touch(handler)

    def _expire(self, handler: _TrackedHandler) -> None:
        if self.deadlines.pop(handler, None) is not None:  # no complete request in time
            self.lost(handler)
            handler.force_close()

    def lost(self, handler: _TrackedHandler) -> None:
        """Forget a connection (closed by either side; idempotent)."""
        self._unsilence(handler)
        peer = self.open.pop(handler, None)
        if peer is not None:
            mine = self.by_peer[peer]
            del mine[handler]
            if not mine:
                del self.by_peer[peer]
        self.busy.pop(handler, None)
        timer = self.deadlines.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def started(self, handler) -> None:
        """A complete request arrived on ``handler``."""
        self._unsilence(handler)
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
        self._touch(handler)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Marks the connection mid-request; refuses request bodies over their bound."""
        protocol = request.protocol
        self.started(protocol)
        try:
            length = request.content_length
            limit = self.body_limit(request)
            if request.body_exists and (length is None or length > limit):
                reply = web.json_response(
                    {"error": f"request body too large for {request.method} {request.path} (at "
                              f"most {limit} bytes, with a Content-Length, not chunked)"}, status=413)
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
                 max_connections: int | None = None,
                 body_limit: Callable[[web.Request], int] | None = None, **kwargs) -> None:
        idle = HTTP_IDLE_SECONDS if idle_seconds is None else idle_seconds
        # lingering_time=0: a body left unread is not drained after the answer (aiohttp
        # reads and drops it for up to 10 s: gigabytes on the event loop); the connection
        # closes instead. read_bufsize: what the parser buffers of a body before pausing.
        super().__init__(app, keepalive_timeout=idle, lingering_time=0,
                         read_bufsize=HTTP_MAX_BODY_BYTES, **kwargs)
        cap = HTTP_MAX_CONNECTIONS if max_connections is None else max_connections
        self.book = _ConnectionBook(cap, min(HTTP_MAX_SILENT, cap), HTTP_MAX_SILENT_PER_PEER,
                                    HTTP_FIRST_REQUEST_SECONDS, body_limit)
        app.middlewares.insert(0, self.book.middleware)

    async def serve(self, host: str, port: int, ssl_context=None) -> int:
        """Set up and listen on ``host:port`` with :data:`HTTP_BACKLOG`; the bound port."""
        await self.setup()
        await web.TCPSite(self, host, port, ssl_context=ssl_context, backlog=HTTP_BACKLOG).start()
        return self.addresses[0][1]

    async def _make_server(self):
        return _CappedFactory(await super()._make_server(), self.book)
