"""A weight-broadcast listener's door: who may become the update's upstream.

A replica's listener (:class:`podium.rollout.broadcast.WeightReceiver`) is reachable by anyone
who can reach its node, and before issue #48 it took the first connection as its upstream: a
port scan that arrived first failed the update, and the rollout manager then retired every
replica behind it. :class:`Doorman` instead keeps accepting until one connection presents
the update's token in its HELLO, or the update's own timeout passes:

- a connection is given :data:`~podium.rollout.broadcast.HELLO_SECONDS` and
  :data:`~podium.rollout.broadcast.MAX_HELLO_BYTES` for its HELLO;
- at most :data:`~podium.rollout.broadcast.MAX_UNAUTHENTICATED` connections wait at once,
  and past that the oldest is closed (the real upstream's HELLO follows its connect within a
  round trip, so idle sockets opened before it go first);
- a connection that sends anything else is closed, and counted in the error the update ends
  with if no upstream ever comes. It never fails the update by itself.

One thread does it all with a selector: nothing is allocated per connection but its few
bytes of HELLO (and, under TLS, its handshake's buffers).

Under mutual TLS (the process has ``PODIUM_TLS_CERT``/``KEY``/``CA``, as every worker of a
TLS cluster does) every link of the chain is TLS with the cluster's certificates: the
listener requires a client certificate signed by the cluster CA before it reads a HELLO, and
:func:`connect` checks the replica's certificate. The weights, the per-update token and
shared-memory segment names then never cross the network in clear.
"""

from __future__ import annotations

import collections
import os
import selectors
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from podium.errors import DataLossError, InvalidArgumentError, UnavailableError

__all__ = ["Doorman", "connect", "tls_context"]


def _tls() -> Any:
    from podium.auth import TlsConfig

    return TlsConfig.from_paths(os.environ.get("PODIUM_TLS_CERT"), os.environ.get("PODIUM_TLS_KEY"),
                                os.environ.get("PODIUM_TLS_CA"))


def tls_context(server: bool) -> ssl.SSLContext | None:
    """The chain's TLS context under the cluster's mutual TLS (None without it): a server
    side requires a client certificate signed by the cluster CA."""
    tls = _tls()
    return tls.ssl_context(server=server) if tls is not None else None


def connect(peer: dict, timeout: float, what: str) -> socket.socket:
    """A connection to the replica whose metadata is ``peer`` (TLS under mutual TLS)."""
    try:
        sock = socket.create_connection((peer["host"], int(peer["port"])), timeout=timeout)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"weight broadcast: {what} metadata {peer!r} has no host/port") from exc
    except OSError as exc:
        raise UnavailableError(f"weight broadcast: cannot reach {what} {peer.get('name', '?')} at "
                               f"{peer.get('host')}:{peer.get('port')}: {exc}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tls = _tls()
    if tls is None:
        return sock
    try:
        return tls.ssl_context(server=False).wrap_socket(sock, server_hostname=tls.server_name or str(peer["host"]))
    except OSError as exc:
        sock.close()
        raise UnavailableError(f"weight broadcast: the TLS handshake with {what} {peer.get('name', '?')} at "
                               f"{peer.get('host')}:{peer.get('port')} failed: {exc}") from None


class Doorman:
    """Admits the one connection whose HELLO checks out; closes the others.

    ``head_size`` is the frame header's size; ``length(head)`` the HELLO manifest's length
    (DataLossError when the header is not a HELLO's, or announces more than the bound);
    ``check(head, manifest)`` the HELLO as a dict once its token is right (DataLossError
    otherwise)."""

    def __init__(self, listener: socket.socket, name: str, head_size: int, length: Callable[[bytes], int],
                 check: Callable[[bytes, bytes], dict], per_connection: float, most: int,
                 tls: ssl.SSLContext | None = None) -> None:
        self.listener = listener
        self.name = name
        self.head_size = head_size
        self.length = length
        self.check = check
        self.per_connection = per_connection
        self.most = most
        #: Under mutual TLS: the server context each connection's handshake runs under.
        self.tls = tls
        #: connection -> [deadline, bytes so far, peer]
        self._waiting: collections.OrderedDict[socket.socket, list] = collections.OrderedDict()
        self.refused = 0
        self.last_refusal = ""

    def admit(self, timeout: float) -> tuple[socket.socket, tuple, dict]:
        """``(connection, peer, hello)`` of the upstream; UnavailableError when none came in
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        selector = selectors.DefaultSelector()
        self.listener.setblocking(False)
        selector.register(self.listener, selectors.EVENT_READ)
        try:
            while True:
                now = time.monotonic()
                self._expire(selector, now)
                if now >= deadline:
                    why = (f"; {self.refused} connection(s) without the token were closed, the last: "
                           f"{self.last_refusal}") if self.refused else ""
                    raise UnavailableError(f"weight broadcast: replica {self.name} waited {timeout:g} s "
                                           f"and no upstream connected{why}")
                wake = min([deadline, *(entry[0] for entry in self._waiting.values())])
                for key, _ in selector.select(max(0.0, wake - now)):
                    if key.fileobj is self.listener:
                        self._accept(selector)
                        continue
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    admitted = self._read(selector, conn)
                    if admitted is not None:
                        return admitted
        finally:
            selector.close()
            for conn in self._waiting:
                conn.close()
            self._waiting.clear()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            conn, peer = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self._waiting) >= self.most:
            oldest = next(iter(self._waiting))
            self._refuse(selector, oldest, "closed to make room for newer connections")
        conn.setblocking(False)
        if self.tls is not None:  # the handshake runs in steps, as its bytes arrive
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        # [deadline, HELLO bytes so far, peer, TLS handshake still to finish]
        self._waiting[conn] = [time.monotonic() + self.per_connection, b"", peer, self.tls is not None]
        selector.register(conn, selectors.EVENT_READ)

    def _read(self, selector: selectors.BaseSelector, conn: socket.socket) -> tuple[socket.socket, tuple, dict] | None:
        entry = self._waiting[conn]
        try:
            if entry[3]:
                assert isinstance(conn, ssl.SSLSocket)
                conn.do_handshake()
                entry[3] = False
            hello = None
            while hello is None:  # a TLS record may hold more than one recv takes
                got: bytes = entry[1]
                need = self.head_size if len(got) < self.head_size else \
                    self.head_size + self.length(got[:self.head_size])
                chunk = conn.recv(need - len(got))
                if not chunk:
                    raise DataLossError("it closed before its HELLO was whole")
                got = entry[1] = got + chunk
                if len(got) == self.head_size:
                    self.length(got)  # a header that is not a HELLO's is refused before its manifest
                if len(got) >= self.head_size and len(got) == self.head_size + self.length(got[:self.head_size]):
                    hello = self.check(got[:self.head_size], got[self.head_size:])
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except (DataLossError, OSError) as exc:
            self._refuse(selector, conn, str(exc))
            return None
        selector.unregister(conn)
        del self._waiting[conn]
        conn.setblocking(True)
        return conn, entry[2], hello

    def _expire(self, selector: selectors.BaseSelector, now: float) -> None:
        for conn, entry in list(self._waiting.items()):
            if entry[0] <= now:
                self._refuse(selector, conn, f"no HELLO within {self.per_connection:g} s")

    def _refuse(self, selector: selectors.BaseSelector, conn: socket.socket, why: str) -> None:
        peer = self._waiting.pop(conn)[2]
        selector.unregister(conn)
        conn.close()
        self.refused += 1
        self.last_refusal = f"{peer[0]}:{peer[1]}: {why}"
