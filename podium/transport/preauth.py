"""What a connection that has not authenticated yet may hold of a listening process.

A client with no token can open connections and never speak. Each costs the server a
descriptor and whatever it allocates before the token is checked, so without a bound a few
hundred idle sockets exhaust ``RLIMIT_NOFILE`` and lock out the controller (issue #34). The
raw call socket (:mod:`podium.transport.callsocket`) therefore allocates nothing large before
the hello is verified (about 1 KiB of read buffer, no second descriptor), closes a connection
whose hello has not arrived within :data:`HANDSHAKE_SECONDS`, and admits every new connection
through a :class:`PreAuthGate`, which bounds the connections still in their handshake:

- at most :data:`PER_PEER` per peer address, and :data:`LIMIT` in all;
- over either bound the gate *evicts* rather than refuses: it closes the oldest pending
  connection of the peer that holds the most pending slots (the newcomer's own peer when that
  peer is at its bound). A never-speaking connection is always older than a client's fresh
  one, and an attacker holding many slots loses its own first, so a real client's handshake,
  which completes within a round trip, is never starved by idle sockets. Refusing the new one
  instead would let whoever fills the slots first keep everyone else out.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol

from podium import errors

__all__ = ["HANDSHAKE_SECONDS", "LIMIT", "PER_PEER", "MAX_TOKEN_BYTES", "PreAuthGate"]

#: A connection that has not completed its handshake by then is closed (server side).
HANDSHAKE_SECONDS = 5.0
#: Connections of one listening socket still in their handshake, at most.
LIMIT = 256
#: ... of which from one peer address, at most.
PER_PEER = 64
#: The longest token a hello may carry (a Podium token is 43 characters).
MAX_TOKEN_BYTES = 1024


class Pending(Protocol):
    """A connection the gate holds (a server-side ``FrameConnection``)."""

    def abort(self, exc: BaseException) -> None:
        """End the connection now."""


class PreAuthGate:
    """The pending (not yet authenticated) connections of one listening socket (see the
    module docstring). Used on the event loop only."""

    def __init__(self, limit: int = LIMIT, per_peer: int = PER_PEER) -> None:
        self._limit = limit
        self._per_peer = per_peer
        # Connection -> its peer, oldest first; and per peer its connections, oldest first.
        self._pending: collections.OrderedDict[Any, str] = collections.OrderedDict()
        self._by_peer: dict[str, collections.OrderedDict[Any, None]] = {}
        #: Connections closed to make room (tests and logs).
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._pending)

    def admit(self, conn: Pending, peer: str) -> None:
        """Hold ``conn`` (from ``peer``) until :meth:`leave`; evicts to stay within bounds."""
        mine = self._by_peer.get(peer)
        if mine is not None and len(mine) >= self._per_peer:
            self._evict(next(iter(mine)))
        elif len(self._pending) >= self._limit:
            crowded = max(self._by_peer.values(), key=len)
            self._evict(next(iter(crowded)))
        self._pending[conn] = peer
        self._by_peer.setdefault(peer, collections.OrderedDict())[conn] = None

    def leave(self, conn: Any) -> None:
        """``conn`` authenticated or ended: it no longer counts (a no-op when not held)."""
        peer = self._pending.pop(conn, None)
        if peer is None:
            return
        mine = self._by_peer[peer]
        del mine[conn]
        if not mine:
            del self._by_peer[peer]

    def _evict(self, conn: Any) -> None:
        self.leave(conn)
        self.evicted += 1
        conn.abort(errors.ResourceExhaustedError(
            "raw call connection closed: too many connections waiting to authenticate"))
