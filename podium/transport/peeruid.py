"""Which local user holds the other end of a TCP connection on this host.

A shared-memory segment named by a peer is mapped only when it is a file of this user
(:func:`podium.transport.shm.read_segment`), but a peer of another local user who holds the
cluster token could still name one of this user's segments (``/dev/shm`` lists them) and make
a worker map, and consume, another job's data (issue #48). The kernel knows the owner of
every socket in this network namespace: ``/proc/net/tcp`` and ``/proc/net/tcp6`` list each
with its addresses and uid, so the end whose local address is this connection's peer
address, and whose remote address is this connection's own, is the peer's.
:func:`peer_uid` reads it once per connection. A peer outside this namespace (another host,
or a container with a network of its own) is not listed: None.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["peer_uid"]


def _hex_address(address: tuple) -> tuple[str, str] | None:
    """``address`` (host, port, ...) as /proc/net/tcp writes it, and which file lists it."""
    host, port = address[0], address[1]
    try:
        packed = socket.inet_pton(socket.AF_INET, host)
        return f"{struct.unpack('<I', packed)[0]:08X}:{port:04X}", "/proc/net/tcp"
    except OSError:
        pass
    try:
        packed = socket.inet_pton(socket.AF_INET6, host.split("%")[0])
    except OSError:
        return None
    words = struct.unpack("<4I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}", "/proc/net/tcp6"


def peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of connected TCP socket ``sock``, when that end is a
    socket of this host's network namespace; None otherwise (or when it cannot be told)."""
    try:
        mine, theirs = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    ours, peer = _hex_address(mine), _hex_address(theirs)
    if ours is None or peer is None or ours[1] != peer[1]:
        return None
    try:
        with open(peer[1]) as table:
            next(table)  # the header
            for line in table:
                fields = line.split()
                if len(fields) > 7 and fields[1] == peer[0] and fields[2] == ours[0]:
                    return int(fields[7])
    except (OSError, ValueError, StopIteration):
        return None
    return None
