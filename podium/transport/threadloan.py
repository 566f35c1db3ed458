"""What another thread borrows of a raw call connection: its read side and small writes.

The worker's execution thread answers fast calls itself while the loop has nothing to do
(:mod:`podium.worker.host.directcalls`): it reads the socket through a descriptor lent to it
(:meth:`ThreadLoan.lend_reads`, handed back with :meth:`ThreadLoan.take_back`), and sends its
small replies on a second descriptor (:meth:`ThreadLoan.write_from_thread`) without waking
the loop. Only a server-side plain-TCP connection lends anything (uvloop encrypts TLS on the
loop); on any other connection every request here is refused.

The connection keeps the protocol's state (its buffers, frames, send queue) and answers the
questions a loan asks of it (:class:`LoanedConnection`); the loan keeps what crosses threads:
the descriptor, the lock that orders thread sends with the loop's writes, and what such a
send left unsent (``tail``), which goes before anything else.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from podium.transport.frames import FRAME_LENGTH

__all__ = ["LoanedConnection", "ThreadLoan"]


class LoanedConnection(Protocol):
    """What a :class:`ThreadLoan` asks of its connection (a ``FrameConnection``)."""

    @property
    def closed(self) -> bool:
        """True once the connection has ended."""

    def holds_input(self) -> bool:
        """True while the loop has input in hand (bytes, frames, a bulk payload), is not
        handshaken, or the peer is done: the read side cannot be lent then."""

    def holds_output(self) -> bool:
        """True while anything written on the loop has not left yet (or the connection ends)."""

    def take_lent_input(self, frames: Iterable[Any], data: bytes) -> None:
        """Take ``frames`` and then ``data`` as if just read, end the loan, resume reading."""


class ThreadLoan:
    """One connection's loan to another thread (see the module docstring). Made with the
    connection; :meth:`attach` arms it (server side, plain TCP), :meth:`end` disarms it."""

    __slots__ = ("_conn", "_loop", "_transport", "direct", "lock", "recall", "tail")

    def __init__(self, conn: LoanedConnection, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn
        self._loop = loop
        self._transport: Any = None
        #: The second descriptor thread sends go on (None: nothing is lent).
        self.direct: socket.socket | None = None
        #: Orders thread sends with the loop's writes (the connection writes under it).
        self.lock = threading.Lock()
        #: While the read side is lent: the borrower's ``recall()``, else None.
        self.recall: Callable[[], None] | None = None
        #: What a thread send left unsent: the loop writes it before anything else.
        self.tail: memoryview | None = None

    def attach(self, transport: Any, sock: socket.socket) -> None:
        """Arm the loan on ``transport``'s socket ``sock`` (connection_made, on the loop)."""
        self._transport = transport
        self.direct = socket.socket(fileno=os.dup(sock.fileno()))

    def end(self) -> None:
        """The connection ended (on the loop): a lent read side is recalled (the borrower's
        descriptor keeps the socket open until it lets go)."""
        if self.recall is not None:
            self.recall()

    def close_locked(self) -> None:
        """Close the second descriptor (under :attr:`lock`): the socket ends with its last one."""
        if self.direct is not None:
            self.direct.close()
            self.direct = None

    def lend_reads(self, recall: Callable[[], None]) -> socket.socket | None:
        """Let another thread read the socket (on the loop).

        Returns a descriptor of the socket that the borrower reads from and closes, or None
        when the read side cannot go now: the connection is not a handshaken plain-TCP server
        one, or bytes, frames or a bulk payload are still in hand there. The loop reads
        nothing until :meth:`take_back`; ``recall()`` asks for it back (it runs when the
        connection ends). Writing is not lent: the borrower answers with
        :meth:`write_from_thread`.
        """
        direct = self.direct
        if (direct is None or self.recall is not None or self._conn.holds_input()
                or self._transport.is_closing()):
            return None
        sock = socket.socket(fileno=os.dup(direct.fileno()))
        self.recall = recall
        self._transport.pause_reading()
        return sock

    def take_back(self, frames: Iterable[Any] = (), data: bytes = b"") -> None:
        """The borrower of :meth:`lend_reads` lets go (on the loop): ``frames`` it parsed but
        did not handle, then ``data``, the bytes it read after them, are taken as if the
        connection had just read them, and reading resumes."""
        if self._conn.closed or self._transport.is_closing():
            self.recall = None
            return
        self._conn.take_lent_input(frames, data)

    def write_from_thread(self, message: bytes) -> bool:
        """Send a small serialized message from a thread other than the loop's, without
        waking the loop. It goes only when nothing is queued ahead of it; then it is sent,
        or its unsent rest is queued for the loop to write before anything else (True).
        False: nothing was written; write it on the loop instead."""
        return self.write_frames_from_thread(FRAME_LENGTH.pack(len(message)) + message)

    def write_frames_from_thread(self, data: bytes) -> bool:
        """:meth:`write_from_thread` of ``data``, small frames already length-prefixed (a
        batch of replies in one send)."""
        with self.lock:
            direct = self.direct
            if direct is None or self.tail is not None or self._conn.holds_output():
                return False
            try:
                sent = direct.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:  # the loop's own write meets the same error and ends the connection
                return False
            if sent < len(data):
                self.tail = memoryview(data)[sent:]
                self._loop.call_soon_threadsafe(self._write_tail)
        return True

    def _write_tail(self) -> None:
        with self.lock:
            if self.tail is not None and not self._conn.closed:
                self.write_tail_locked()

    def write_tail_locked(self) -> None:
        """Write what a thread send left unsent (on the loop, under :attr:`lock`)."""
        tail, self.tail = self.tail, None
        self._transport.write(tail)
