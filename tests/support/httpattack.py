"""A client without the token attacking an HTTP port, as issue #34 drove it: connections
that never speak, each re-opened the moment the server closes it, and endless bodies."""

from __future__ import annotations

import asyncio
import contextlib
import socket

__all__ = ["SilentFlood", "probe", "endless_chunked_post"]


class SilentFlood:
    """``lanes`` connections to ``host:port`` from ``source`` (an address of this host, e.g.
    127.0.0.2: another pod than the kubelet's node address) that never send a byte; each
    one the server closes is opened again at once, until the ``async with`` block ends.
    With ``first`` each sends those bytes (a request's first byte, say) and then nothing."""

    def __init__(self, host: str, port: int, lanes: int, source: str = "127.0.0.2",
                 first: bytes = b"") -> None:
        self.host, self.port, self.lanes, self.source = host, port, lanes, source
        self.first = first
        #: Connections opened, and closed by the server, so far.
        self.opened = 0
        self.closed_by_server = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _lane(self) -> None:
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port,
                                                             local_addr=(self.source, 0))
            except OSError:
                await asyncio.sleep(0.01)  # the backlog is full: try again
                continue
            self.opened += 1
            if self.first:
                writer.write(self.first)
            stop = asyncio.ensure_future(self._stop.wait())
            closed = asyncio.ensure_future(reader.read())
            await asyncio.wait({stop, closed}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if closed.done():
                self.closed_by_server += 1
            else:
                closed.cancel()
            writer.close()
            with contextlib.suppress(Exception):
                await closed

    async def __aenter__(self) -> SilentFlood:
        self._tasks = [asyncio.ensure_future(self._lane()) for _ in range(self.lanes)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 30)


async def probe(host: str, port: int, path: str, token: str | None = None,
                timeout: float = 5.0) -> int:
    """One kubelet-style probe: a new connection, ``GET path``, the status (0: no answer)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n".encode()

    async def ask() -> int:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(request)
            line = await reader.readline()
            return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0
        finally:
            writer.close()

    try:
        return await asyncio.wait_for(ask(), timeout)
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        return 0


def endless_chunked_post(host: str, port: int, path: str, limit: int, method: str = "POST",
                         headers: str = "") -> tuple[bytes, int]:
    """POST (or ``method``) a chunked body of 64 KiB chunks to ``path`` until the server closes
    the connection or ``limit`` bytes went out; returns (the answer's status line, bytes sent)."""
    chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
    sent = 0
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}"
                     f"Transfer-Encoding: chunked\r\n\r\n".encode())
        sock.sendall(chunk)
        sent += len(chunk)
        status = sock.makefile("rb").readline().strip()
        try:
            while sent < limit:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset or broken pipe: the server closed it
            pass
    return status, sent


def declared_body(host: str, port: int, method: str, path: str, length: int, limit: int,
                  headers: str = "") -> tuple[bytes, int]:
    """Send a request declaring a ``length``-byte body, then body bytes until the server
    closes the connection or ``limit`` bytes went out; (the answer's status line, bytes sent)."""
    block = b"x" * 65536
    sent = 0
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}"
                     f"Content-Length: {length}\r\n\r\n".encode())
        sock.sendall(block)
        sent += len(block)
        status = sock.makefile("rb").readline().strip()
        try:
            while sent < limit:
                sock.sendall(block)
                sent += len(block)
        except OSError:  # reset or broken pipe: the server closed it
            pass
    return status, sent
