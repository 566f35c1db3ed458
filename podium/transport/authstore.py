"""A key-value store for ``torch.distributed`` rendezvous that only its key holders can use.

torch's ``TCPStore`` listens on every interface and serves anyone who connects: a client
with no credentials can list, read, write and delete its keys and park memory in the
process that opened it (issue #48). Podium's process groups (the weight carrier of
:mod:`podium.rollout.broadcastcollective`, ``ray.util.collective``'s groups) rendezvous
through this store instead:

- :class:`StoreServer` listens on the one address it is given (the node's), on a socket it
  binds itself;
- every connection starts with a mutual challenge: the server sends a nonce, the client
  answers with HMAC-SHA256 of it under the group's key and sends a nonce of its own, which
  the server answers the same way. The key travels only inside Podium's authenticated calls
  (a rendezvous actor, a worker group's call arguments), so a client without the cluster
  token never gets a request read, and a rank never talks to a store that is not its group's
  (a stale address now served by someone else fails the challenge at once);
- before the challenge a connection may send :data:`CHALLENGE_BYTES` bytes and hold a slot
  for :data:`HANDSHAKE_SECONDS`; at most :data:`MAX_PENDING` connections may be in their
  challenge at once, and at most :data:`MAX_CLIENTS` past it. Over the first bound the oldest
  pending connection is closed, not the newcomer (as :mod:`podium.transport.preauth`): a
  rank's handshake takes a round trip, so idle sockets opened earlier go before it does;
- what key holders store is bounded too: :data:`MAX_KEY_BYTES`, :data:`MAX_VALUE_BYTES` a
  value, :data:`MAX_KEYS` keys and :data:`MAX_STORE_BYTES` in all.

:class:`StoreClient` is a ``torch.distributed.Store`` (torch's Python-store trampoline), so
``PrefixStore``, ``ProcessGroupGloo`` and ``ProcessGroupNCCL`` take it as they take a
``TCPStore``. Keep a Python reference to it for as long as a process group uses it: the
trampoline calls back into the Python object.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
import time
from typing import Any

from podium.errors import (
    AuthenticationError,
    DeadlineExceededError,
    FailedPreconditionError,
    ResourceExhaustedError,
    UnavailableError,
)

__all__ = ["HANDSHAKE_SECONDS", "MAX_PENDING", "MAX_CLIENTS", "MAX_VALUE_BYTES", "MAX_STORE_BYTES",
           "StoreClient", "StoreServer", "connect_store", "derived_key", "new_key"]

#: A connection that has not answered the challenge by then is closed.
HANDSHAKE_SECONDS = 5.0
#: Connections in their challenge at once; past it the oldest is closed.
MAX_PENDING = 64
#: Connections past the challenge at once (a group's ranks, each with a few).
MAX_CLIENTS = 4096
#: Bytes a client sends before it is authenticated: its answer and its own nonce.
CHALLENGE_BYTES = 64
MAX_KEY_BYTES = 4096
#: A value's bound: a weight bucket's manifest (16 MiB) and its framing.
MAX_VALUE_BYTES = (16 << 20) + 4096
MAX_KEYS = 1 << 16
MAX_STORE_BYTES = 256 << 20
#: Keys one check/wait may name.
MAX_WAIT_KEYS = 4096

_MAGIC = b"PDKS"
_REQUEST = struct.Struct("!BIIq")  # op, key length, value length, argument
_REPLY = struct.Struct("!BI")  # status, length
_SET, _GET, _ADD, _CHECK, _WAIT, _CSET, _DELETE, _COUNT = range(1, 9)
_OK, _TIMEOUT, _REFUSED, _FULL, _GONE = 0, 1, 2, 3, 4
#: A blocking get/wait is served in slices this long, so one thread's wait does not hold
#: the client's connection against the others of its process.
_SLICE_S = 0.5


def new_key() -> str:
    """A fresh group key (hex), for metadata that travels over Podium's authenticated calls."""
    return secrets.token_hex(32)


def derived_key(token: str, purpose: str) -> str:
    """A group key derived from the cluster token (hex), for ranks that share the token and
    ``purpose`` (a group's address) but no channel to pass a fresh key on."""
    return hmac.new(token.encode(), b"podium-store/" + purpose.encode(), hashlib.sha256).hexdigest()


def connect_store(host: str, port: int, key: str, timeout: float) -> "StoreClient":
    """:class:`StoreClient` to a server that may not listen yet (a rank that started before
    rank 0): retried while the connection is refused, up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return StoreClient(host, port, key, timeout)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _mac(key: bytes, who: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, who + nonce, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise UnavailableError("the store connection closed")
        data += chunk
    return bytes(data)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class StoreServer:
    """The store itself, in threads of the process that opened it (a group's rank 0)."""

    def __init__(self, host: str, key: str, port: int = 0, listener: socket.socket | None = None) -> None:
        """Listen on ``host:port``, or serve on ``listener``, a socket already bound there and
        listening (a group's held MASTER_PORT: :func:`podium.worker.masterstore.take`)."""
        self.host = host
        self._key = bytes.fromhex(key)
        if listener is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind((host, port))
                listener.listen(128)
            except OSError:
                listener.close()
                raise
        self._listener = listener
        #: The port it listens on, at :attr:`host` only.
        self.port: int = listener.getsockname()[1]
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self._pending: collections.deque[socket.socket] = collections.deque()
        self._clients: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name=f"podium-store:{self.port}", daemon=True).start()

    def close(self) -> None:
        """Stop listening and drop every connection (waiting clients get an error)."""
        with self._cond:
            self._closed = True
            clients, self._clients = [*self._clients, *self._pending], set()
            self._cond.notify_all()
        for sock in (self._listener, *clients):
            _shut(sock)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                if len(self._pending) >= MAX_PENDING:  # its thread sees the end and leaves
                    _shut(self._pending.popleft())
                self._pending.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                if not self._challenge(conn):
                    return
                with self._cond:
                    if self._closed or len(self._clients) >= MAX_CLIENTS:
                        return
                    self._clients.add(conn)
                try:
                    self._requests(conn)
                finally:
                    with self._cond:
                        self._clients.discard(conn)
        except (OSError, ValueError, RecursionError, struct.error):  # a peer gone, or a malformed request
            return

    def _challenge(self, conn: socket.socket) -> bool:
        try:
            conn.settimeout(HANDSHAKE_SECONDS)
            nonce = secrets.token_bytes(32)
            conn.sendall(_MAGIC + nonce)
            answer = _recv_exactly(conn, CHALLENGE_BYTES)
            if not hmac.compare_digest(answer[:32], _mac(self._key, b"client", nonce)):
                return False
            conn.sendall(_mac(self._key, b"server", answer[32:]))
            conn.settimeout(None)  # a rank may stay quiet between updates for as long as it likes
            return True
        finally:
            with self._cond:
                if conn in self._pending:
                    self._pending.remove(conn)

    def _requests(self, conn: socket.socket) -> None:
        while True:
            op, key_len, value_len, arg = _REQUEST.unpack(_recv_exactly(conn, _REQUEST.size))
            if key_len > MAX_KEY_BYTES or value_len > MAX_VALUE_BYTES:
                return  # a key holder gone wrong: drop it rather than read a huge body
            conn.settimeout(HANDSHAKE_SECONDS * 6)  # a request, once started, arrives whole
            key = _recv_exactly(conn, key_len).decode("utf-8", "surrogateescape")
            value = _recv_exactly(conn, value_len)
            conn.settimeout(None)
            status, reply = self._apply(op, key, value, arg)
            conn.sendall(_REPLY.pack(status, len(reply)) + reply)

    def _apply(self, op: int, key: str, value: bytes, arg: int) -> tuple[int, bytes]:
        with self._cond:
            if op == _SET:
                return self._put(key, value)
            if op == _GET:
                if not self._cond.wait_for(lambda: key in self._data or self._closed, min(arg, 1000 * _SLICE_S) / 1000):
                    return _TIMEOUT, b""
                return (_OK, self._data[key]) if key in self._data else (_GONE, b"the store closed")
            if op == _ADD:
                try:
                    total = int(self._data.get(key, b"0")) + arg
                except ValueError:
                    return _REFUSED, f"key {key!r} does not hold a number".encode()
                return self._put(key, str(total).encode(), str(total).encode())
            if op in (_CHECK, _WAIT):
                keys = json.loads(value)
                if not isinstance(keys, list) or len(keys) > MAX_WAIT_KEYS:
                    return _REFUSED, b"a key list over the bound"
                if op == _CHECK:
                    return _OK, b"1" if all(k in self._data for k in keys) else b"0"
                ready = self._cond.wait_for(lambda: all(k in self._data for k in keys) or self._closed,
                                            min(arg, 1000 * _SLICE_S) / 1000)
                return (_OK, b"") if ready and not self._closed else (_TIMEOUT, b"")
            if op == _CSET:
                (expected_len,) = struct.unpack_from("!I", value)
                expected, desired = value[4:4 + expected_len], value[4 + expected_len:]
                current = self._data.get(key)
                if (current is None and not expected) or current == expected:
                    return self._put(key, desired, desired)
                return _OK, current if current is not None else expected
            if op == _DELETE:
                old = self._data.pop(key, None)
                self._bytes -= len(key) + len(old) if old is not None else 0
                return _OK, b"1" if old is not None else b"0"
            if op == _COUNT:
                return _OK, str(len(self._data)).encode()
            return _REFUSED, f"unknown store operation {op}".encode()

    def _put(self, key: str, value: bytes, reply: bytes = b"") -> tuple[int, bytes]:
        old = self._data.get(key)
        grown = len(value) - (len(old) if old is not None else -len(key))
        if (old is None and len(self._data) >= MAX_KEYS) or self._bytes + grown > MAX_STORE_BYTES:
            return _FULL, (f"the store is full ({len(self._data)} keys, {self._bytes} bytes; bounds "
                              f"{MAX_KEYS}, {MAX_STORE_BYTES})").encode()
        self._data[key] = value
        self._bytes += grown
        self._cond.notify_all()
        return _OK, reply


def _store_base() -> Any:
    import torch.distributed as dist

    return dist.Store


class StoreClient(_store_base()):  # type: ignore[misc]
    """A connection to a :class:`StoreServer`, usable wherever torch takes a ``Store``.

    Raises :class:`~podium.errors.AuthenticationError` when the server does not answer the
    challenge with the key (not this group's store), ``OSError`` when it is unreachable;
    operations raise :class:`~podium.errors.UnavailableError` when the connection fails,
    :class:`~podium.errors.ResourceExhaustedError` over the store's bounds,
    :class:`~podium.errors.FailedPreconditionError` on another refusal and
    :class:`~podium.errors.DeadlineExceededError` past the timeout (each an ``OSError``,
    but for the bounds and the refusals)."""

    def __init__(self, host: str, port: int, key: str, timeout: float) -> None:
        super().__init__()
        self._key = bytes.fromhex(key)
        self._wait_s = float(timeout)
        self._lock = threading.Lock()
        sock = socket.create_connection((host, port), timeout=min(self._wait_s, HANDSHAKE_SECONDS * 2))
        try:
            head = _recv_exactly(sock, 4 + 32)
            mine = secrets.token_bytes(32)
            if head[:4] != _MAGIC:
                raise AuthenticationError(f"{host}:{port} is not a Podium store")
            sock.sendall(_mac(self._key, b"client", head[4:]) + mine)
            if not hmac.compare_digest(_recv_exactly(sock, 32), _mac(self._key, b"server", mine)):
                raise AuthenticationError(f"the store at {host}:{port} does not hold this group's key")
        except OSError as exc:
            sock.close()
            if isinstance(exc, AuthenticationError):
                raise
            raise AuthenticationError(f"the store at {host}:{port} refused this group's key: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(_SLICE_S + HANDSHAKE_SECONDS * 6)
        self._sock: socket.socket | None = sock
        self._address = (host, port, key)
        #: Clones handed to torch: torch calls back into them, so they live as long as this.
        self._clones: list[StoreClient] = []

    def clone(self) -> "StoreClient":
        """A second connection to the same store (torch asks for one per background thread)."""
        other = StoreClient(*self._address, self._wait_s)
        self._clones.append(other)
        return other

    def close(self) -> None:
        """Drop the connection (and its clones')."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        for other in self._clones:
            other.close()

    def _call(self, op: int, key: str = "", value: bytes = b"", arg: int = 0) -> tuple[int, bytes]:
        raw = key.encode("utf-8", "surrogateescape")
        with self._lock:
            if self._sock is None:
                raise UnavailableError("the store connection is closed")
            try:
                self._sock.sendall(_REQUEST.pack(op, len(raw), len(value), arg) + raw + value)
                status, length = _REPLY.unpack(_recv_exactly(self._sock, _REPLY.size))
                reply = _recv_exactly(self._sock, length)
            except OSError as exc:
                self.close()
                raise UnavailableError(f"the store connection failed: {exc}") from None
        if status == _FULL:
            raise ResourceExhaustedError(reply.decode(errors="replace"))
        if status == _GONE:  # its owner closed the group: as a lost connection, the peer is gone
            raise UnavailableError(f"the store's owner ended the group: {reply.decode(errors='replace')}")
        if status == _REFUSED:
            raise FailedPreconditionError(f"the store refused: {reply.decode(errors='replace')}")
        return status, reply

    def _blocking(self, op: int, key: str, value: bytes, timeout: float | None) -> bytes:
        deadline = time.monotonic() + (self._wait_s if timeout is None else timeout)
        while True:
            left = deadline - time.monotonic()
            status, reply = self._call(op, key, value, max(1, int(min(left, _SLICE_S) * 1000)))
            if status == _OK:
                return reply
            if left <= 0:
                raise DeadlineExceededError(f"the store did not get {key or json.loads(value)!r} within the timeout")

    @staticmethod
    def _bytes(value: Any) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key``."""
        self._call(_SET, key, self._bytes(value))

    def get(self, key: str) -> bytes:
        """``key``'s value, waiting for it up to the timeout."""
        return self._blocking(_GET, key, b"", None)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the number under ``key`` (0 if none); the new number."""
        return int(self._call(_ADD, key, b"", int(amount))[1])

    def check(self, keys: list[str]) -> bool:
        """True when every key is set."""
        return self._call(_CHECK, "", json.dumps(list(keys)).encode())[1] == b"1"

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        """Return once every key is set (DeadlineExceededError past ``timeout``, a timedelta)."""
        seconds = timeout.total_seconds() if timeout is not None else None
        self._blocking(_WAIT, "", json.dumps(list(keys)).encode(), seconds)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is unset and ``expected`` is
        empty); the value it holds afterwards."""
        old = self._bytes(expected)
        return self._call(_CSET, key, struct.pack("!I", len(old)) + old + self._bytes(desired))[1]

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        return self._call(_DELETE, key)[1] == b"1"

    def num_keys(self) -> int:
        """How many keys the store holds."""
        return int(self._call(_COUNT)[1])
