"""Weight broadcast to rollout replicas: one bucketed, pipelined TCP chain, verl's engine shape.

The trainer's rank 0 (:class:`WeightSender`) streams its weights to the first replica; every
replica (:class:`WeightReceiver`) forwards each block to the next one as soon as it has read
it, so the chain carries the weights once per link and all links run at once: eight replicas
cost about one replica's time plus the chain's depth in blocks, not eight transfers.

The shape is verl's ``CheckpointEngine``: a receiver's :meth:`WeightReceiver.prepare` returns
the metadata to rendezvous (its address, and a one-update token the upstream must present),
:func:`build_topology` turns the replicas' metadata into each one's downstream, the sender's
``send_weights(iterator of (name, tensor))`` and the receiver's ``receive_weights()`` (an
async generator of ``(name, tensor)``) move them. :func:`podium.rollout.broadcastgroups`
drives the same steps over Podium worker groups.

The stream, per update: a HELLO frame (token, step, and the shared-memory domain when the
buckets come as segments), BUCKET frames (a JSON manifest of ``[name, dtype, shape, offset,
nbytes]`` and the raw bytes, each tensor 64-byte aligned; or, on a link within one host, the
name of a shared-memory segment holding them: :mod:`podium.rollout.broadcastshm`), an END
frame (counts). No frame is ever unpickled, every length has a bound, every socket
wait has a deadline. A receiver hands over its weights only once the END frame checked out,
so a replica whose upstream vanished keeps its previous weights; a replica whose downstream
vanished keeps receiving (its own copy completes) and reports the downstream's failure.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import socket
import struct
from collections.abc import AsyncIterator, Iterable
from typing import Any

from podium.errors import DataLossError, InvalidArgumentError, UnavailableError
from podium.rollout.broadcastdoor import Doorman, connect, tls_context
from podium.rollout.broadcastshm import SENDER, SENDER_LOCK, SegmentWriter, local_domain, map_bucket
from podium.rollout.weights.plan import (
    ALIGN,
    DEFAULT_BUCKET_BYTES,
    MAX_BUCKET_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_TENSORS,
    aligned,
    carried_dtypes,
    check_bucket_bytes,
    check_timeout,
    tensor_views,
)

__all__ = ["DEFAULT_BUCKET_BYTES", "WeightReceiver", "WeightSender", "build_topology", "tensor_views"]

#: A receiver reads (and forwards) at most this much at once: the chain's pipelining grain.
BLOCK_BYTES = 4 << 20
#: Bounds on what a peer may announce.
#: Before it presented the update's token a connection may send a HELLO of at most this many
#: bytes, within :data:`HELLO_SECONDS`; at most :data:`MAX_UNAUTHENTICATED` such connections
#: are held at once (past that the oldest is closed). A connection that fails any of this is
#: closed and the listener goes on waiting for the upstream: it never fails the update.
MAX_HELLO_BYTES = 4096
HELLO_SECONDS = 5.0
MAX_UNAUTHENTICATED = 32

# magic, kind, manifest length, body length
_HEADER = struct.Struct("!4sB3xIQ")
_MAGIC = b"PDWB"
_HELLO, _BUCKET, _END = 1, 2, 3
_ZEROS = bytes(ALIGN)


def _recv_exactly(sock: socket.socket, view: memoryview, who: str) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise UnavailableError(f"weight broadcast: {who} ended the stream "
                                   f"{len(view) - got} bytes short of a frame")
        got += n


def _read_frame_head(sock: socket.socket, who: str) -> tuple[int, dict, int]:
    head = bytearray(_HEADER.size)
    _recv_exactly(sock, memoryview(head), who)
    magic, kind, manifest_len, body_len = _HEADER.unpack(head)
    if magic != _MAGIC or kind not in (_HELLO, _BUCKET, _END):
        raise DataLossError(f"weight broadcast: {who} sent a frame that is not Podium's "
                            f"(magic {magic!r}, kind {kind})")
    if manifest_len > MAX_MANIFEST_BYTES or body_len > MAX_BUCKET_BYTES:
        raise DataLossError(f"weight broadcast: {who} announced a frame of {manifest_len} + {body_len} bytes, "
                            f"over the bounds ({MAX_MANIFEST_BYTES} + {MAX_BUCKET_BYTES})")
    raw = bytearray(manifest_len)
    _recv_exactly(sock, memoryview(raw), who)
    return kind, _manifest(raw, who), body_len


def _manifest(raw: bytes | bytearray, who: str) -> dict:
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
        raise DataLossError(f"weight broadcast: {who} sent a manifest that is not JSON: "
                            f"{exc if isinstance(exc, ValueError) else 'nested too deep'}") from None
    if not isinstance(manifest, dict):
        raise DataLossError(f"weight broadcast: {who} sent a manifest that is not an object")
    return manifest


def _frame_head(kind: int, manifest: dict, body_len: int = 0) -> bytes:
    raw = json.dumps(manifest, separators=(",", ":")).encode()
    return _HEADER.pack(_MAGIC, kind, len(raw), body_len) + raw


class WeightSender:
    """The trainer side: streams ``(name, tensor)`` pairs, in buckets, to the chain's head."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = 120.0) -> None:
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        #: Seconds any one socket operation may stall before the update fails.
        self.timeout = check_timeout(timeout)

    def prepare(self, receivers: list[dict] | None = None) -> dict:
        """Nothing to ready: the replicas listen, the sender connects (the carrier protocol's step)."""
        return {}

    def close(self) -> None:
        """Nothing held between updates."""

    def send(self, weights: Iterable[tuple[str, Any]], head: dict, step: int | None = None) -> dict:
        """Send every pair of ``weights`` to the replica whose metadata is ``head``; returns
        ``{"tensors", "bytes", "buckets"}``. CPU tensors go out of their own memory (no copy);
        others are copied to CPU bucket by bucket."""
        sock = connect(head, self.timeout, "replica")
        domain = local_domain()
        # The head sees this host's /dev/shm: buckets go as segments, written once for the chain.
        segments = SENDER if domain and head.get("shm_domain") == domain else None
        if segments is not None and not SENDER_LOCK.acquire(timeout=self.timeout):
            raise UnavailableError(f"weight broadcast: another update from this process held the shared-memory "
                                   f"segments for {self.timeout:g} s")
        try:
            sock.sendall(_frame_head(_HELLO, {"token": head.get("token", ""), "step": step,
                                              "shm_domain": domain if segments else ""}))
            tensors = total = buckets = 0
            pending: list[tuple[str, Any, Any]] = []  # (name, tensor, its bytes)
            size = 0
            for name, tensor in weights:
                flat = self._bytes_of(name, tensor)
                if pending and size + aligned(flat.numel()) > self.bucket_bytes:
                    total += self._send_bucket(sock, pending, segments, buckets)
                    buckets += 1
                    pending, size = [], 0
                pending.append((name, tensor, flat))
                size += aligned(flat.numel())
                tensors += 1
            if pending:
                total += self._send_bucket(sock, pending, segments, buckets)
                buckets += 1
            if segments is not None:
                segments.trim(buckets)
            sock.sendall(_frame_head(_END, {"tensors": tensors, "bytes": total, "buckets": buckets}))
            self._await_ack(sock, head)
            return {"tensors": tensors, "bytes": total, "buckets": buckets}
        except OSError as exc:
            raise UnavailableError(f"weight broadcast: replica {head.get('name', '?')} at {head.get('host')}:"
                                   f"{head.get('port')} ended the connection mid-update: {exc}") from None
        finally:
            sock.close()
            if segments is not None:
                SENDER_LOCK.release()

    async def send_weights(self, weights: Iterable[tuple[str, Any]], head: dict,
                           global_steps: int | None = None) -> dict:
        """:meth:`send` off the event loop (verl's ``send_weights``, with the head's metadata)."""
        return await asyncio.to_thread(self.send, weights, head, global_steps)

    @staticmethod
    def _bytes_of(name: Any, tensor: Any) -> Any:
        import torch

        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"weights must be (str, torch.Tensor) pairs, got "
                                       f"({type(name).__name__}, {type(tensor).__name__})")
        if str(tensor.dtype).removeprefix("torch.") not in carried_dtypes():
            raise InvalidArgumentError(f"weight {name!r} has dtype {tensor.dtype}, which the broadcast does not carry")
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return tensor.contiguous().reshape(-1).view(torch.uint8)

    def _send_bucket(self, sock: socket.socket, pending: list, segments: SegmentWriter | None, index: int) -> int:
        entries, offset = [], 0
        for name, tensor, flat in pending:
            entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, flat.numel()])
            offset = aligned(offset + flat.numel())
        if segments is not None:
            segment = segments.write(index, [(entry[3], flat) for (_, _, flat), entry in zip(pending, entries)], offset)
            sock.sendall(_frame_head(_BUCKET, {"tensors": entries, "shm": segment, "size": offset}))
            return sum(entry[4] for entry in entries)
        sock.sendall(_frame_head(_BUCKET, {"tensors": entries}, offset))
        for (_, _, flat), entry in zip(pending, entries):
            sock.sendall(memoryview(flat.numpy()))
            pad = aligned(entry[4]) - entry[4]
            if pad:
                sock.sendall(_ZEROS[:pad])
        return sum(entry[4] for entry in entries)

    def _await_ack(self, sock: socket.socket, head: dict) -> None:
        # The head answers once it checked the END frame and heard from the chain behind it
        # (each of which waits at most one timeout per replica after it).
        sock.settimeout(_ack_timeout(self.timeout, head))
        kind, manifest, _ = _read_frame_head(sock, f"replica {head.get('name', '?')}")
        if kind != _END or manifest.get("ok") is not True:
            raise DataLossError(f"weight broadcast: replica {head.get('name', '?')} refused the update: "
                                f"{manifest.get('error', manifest)}")


class WeightReceiver:
    """A replica's side: listens for its upstream, forwards to its downstream, stages the update.

    Tensors handed over are views into this receiver's staging buffers, reused by the next
    update of the same layout (or, on a link within one host, into the sender's shared-memory
    segment): load them (copy into the model) before receiving again.
    """

    def __init__(self, host: str | None = None, name: str = "", timeout: float = 120.0) -> None:
        import os

        #: The address the upstream connects to (this node's, by default).
        self.host = host or os.environ.get("PODIUM_NODE_ADDRESS") or "127.0.0.1"
        #: How errors elsewhere in the chain name this replica.
        self.name = name or f"pid {os.getpid()}"
        self.timeout = check_timeout(timeout)
        self._listener: socket.socket | None = None
        self._token = ""
        self._buffers: list[Any] = []
        #: Segments mapped last update, by name: the sender rewrites the same ones.
        self._mapped: dict[str, Any] = {}
        #: Why the downstream stopped receiving in the last update (None: it did not, or none).
        self.downstream_error: str | None = None

    def prepare(self) -> dict:
        """Open a listening socket for the next update; its metadata for :func:`build_topology`."""
        self.finalize()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, 0))
        listener.listen(128)
        self._listener = listener
        self._token = secrets.token_hex(16)
        return {"name": self.name, "host": self.host, "port": listener.getsockname()[1], "token": self._token,
                "shm_domain": local_domain()}

    def finalize(self) -> None:
        """Close the listening socket (the staging buffers stay for the next update)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def receive(self, downstream: dict | None = None, step: int | None = None) -> list[tuple[str, Any]]:
        """Take one update from the upstream, forwarding it to ``downstream`` (the next
        replica's metadata, None at the chain's end); the ``(name, tensor)`` pairs once the
        whole update arrived and checked out. Raises UnavailableError / DataLossError (and
        hands over nothing) when the upstream fails; a failing downstream is only recorded
        in :attr:`downstream_error`."""
        if self._listener is None:
            raise InvalidArgumentError("weight broadcast: receive before prepare")
        self.downstream_error = None
        down = None
        try:
            try:  # the listener closes whatever happens, so an upstream never waits on a dead end
                down = connect(downstream, self.timeout, "downstream replica") if downstream else None
                conn, peer, hello = self._door().admit(self.timeout)
            finally:
                self.finalize()
            who = f"the upstream at {peer[0]}:{peer[1]}"
            with conn:
                conn.settimeout(self.timeout)
                try:
                    return self._take(conn, who, hello, down, downstream, step)
                except OSError as exc:  # reset, or stalled past the deadline
                    raise UnavailableError(f"weight broadcast: replica {self.name} lost {who} "
                                           f"mid-update: {exc or type(exc).__name__}") from None
        except BaseException:
            # A failed update hands nothing over: its staging buffers go too, so what an
            # upstream sent before failing is not kept until the next update.
            self._buffers, self._mapped = [], {}
            raise
        finally:
            if down is not None:
                down.close()

    async def receive_weights(self, downstream: dict | None = None,
                              global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        """:meth:`receive` off the event loop, yielding the pairs (verl's ``receive_weights``)."""
        for pair in await asyncio.to_thread(self.receive, downstream, global_steps):
            yield pair

    def _door(self) -> Doorman:
        def length(head: bytes) -> int:
            magic, kind, manifest_len, body_len = _HEADER.unpack(head)
            if magic != _MAGIC or kind != _HELLO or body_len or manifest_len > MAX_HELLO_BYTES:
                raise DataLossError(f"a frame that is not a HELLO (magic {magic!r}, kind {kind}, "
                                    f"{manifest_len} + {body_len} bytes)")
            return manifest_len

        def check(head: bytes, raw: bytes) -> dict:
            hello = _manifest(raw, "the connection")
            if not hmac.compare_digest(str(hello.get("token", "")).encode(), self._token.encode()):
                raise DataLossError(f"it did not present replica {self.name}'s token")
            return hello

        assert self._listener is not None
        return Doorman(self._listener, self.name, _HEADER.size, length, check, HELLO_SECONDS, MAX_UNAUTHENTICATED,
                       tls_context(server=True))

    def _take(self, conn: socket.socket, who: str, hello: dict, down: socket.socket | None,
              downstream: dict | None, step: int | None) -> list[tuple[str, Any]]:
        if step is not None and hello.get("step") != step:
            raise DataLossError(f"weight broadcast: {who} sends step {hello.get('step')}, "
                                f"replica {self.name} expected {step}")
        shared = hello.get("shm_domain") or ""
        if shared and shared != local_domain():
            raise DataLossError(f"weight broadcast: {who} sends shared-memory segments of another host")
        # Segment names go on only to a downstream of the same host; another gets the bytes.
        shared_out = bool(shared) and (downstream or {}).get("shm_domain") == shared
        forward = _Forward(down, downstream, self.timeout)
        forward.send(_frame_head(_HELLO, {"token": (downstream or {}).get("token", ""), "step": hello.get("step"),
                                          "shm_domain": shared if shared_out else ""}))
        dtypes = carried_dtypes()
        items: list[tuple[str, Any]] = []
        mapped, now = self._mapped, {}
        total = index = 0
        while True:
            kind, manifest, body_len = _read_frame_head(conn, who)
            if kind == _END:
                break
            if kind != _BUCKET:
                raise DataLossError(f"weight broadcast: {who} sent a frame of kind {kind} mid-update")
            if shared and "shm" in manifest:
                size = manifest.get("size")
                if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_BUCKET_BYTES:
                    raise DataLossError(f"weight broadcast: {who} announced a segment of {size!r} bytes")
                name = manifest["shm"]
                buffer = mapped.get(name)
                if buffer is None or buffer.numel() != size:
                    buffer = map_bucket(name, size, who)
                now[name] = buffer
                if shared_out:
                    forward.send(_frame_head(_BUCKET, manifest))
                else:
                    forward.send(_frame_head(_BUCKET, {"tensors": manifest.get("tensors")}, size))
                    forward.send(memoryview(buffer.numpy()))
            else:
                forward.send(_frame_head(_BUCKET, manifest, body_len))
                buffer = self._buffer(index, body_len)
                self._read_body(conn, memoryview(buffer.numpy()), who, forward)
                index += 1
            total += tensor_views(buffer, manifest.get("tensors"), dtypes, items, who)
        if manifest.get("tensors") != len(items) or manifest.get("bytes") != total or len(items) > MAX_TENSORS:
            raise DataLossError(f"weight broadcast: {who} announced {manifest.get('tensors')} tensors / "
                                f"{manifest.get('bytes')} bytes, replica {self.name} got {len(items)} / {total}")
        del self._buffers[index:]  # a smaller model than last time: drop the buffers it no longer needs
        self._mapped = now  # and the segments it no longer names
        forward.send(_frame_head(_END, manifest))
        forward.settle()
        self.downstream_error = forward.error
        conn.sendall(_frame_head(_END, {"ok": True}))
        return items

    def _buffer(self, index: int, nbytes: int) -> Any:
        import torch

        if index < len(self._buffers) and self._buffers[index].numel() == nbytes:
            return self._buffers[index]
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer

    @staticmethod
    def _read_body(conn: socket.socket, view: memoryview, who: str, forward: _Forward) -> None:
        got = sent = 0
        while got < len(view):
            n = conn.recv_into(view[got:got + BLOCK_BYTES])
            if n == 0:
                raise UnavailableError(f"weight broadcast: {who} ended the stream {len(view) - got} bytes "
                                       f"short of a bucket")
            got += n
            # Forward in blocks, not per recv: fewer sends, and the next replica starts at once.
            if got - sent >= BLOCK_BYTES or got == len(view):
                forward.send(view[sent:got])
                sent = got


class _Forward:
    """The downstream half of a receiver: sends what it is given until the downstream fails,
    then records why and drops the rest (this replica's own copy goes on)."""

    def __init__(self, sock: socket.socket | None, peer: dict | None, timeout: float) -> None:
        self.sock = sock
        self.peer = peer or {}
        self.timeout = timeout
        self.error: str | None = None

    def send(self, data: Any) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendall(data)
        except OSError as exc:
            self._failed(f"ended the connection mid-update: {exc}")

    def settle(self) -> None:
        """Wait for the downstream's acknowledgement of the END frame."""
        if self.sock is None:
            return
        try:
            self.sock.settimeout(_ack_timeout(self.timeout, self.peer))
            kind, manifest, _ = _read_frame_head(self.sock, "downstream")
            if kind != _END or manifest.get("ok") is not True:
                self._failed(f"refused the update: {manifest.get('error', manifest)}")
        except (OSError, UnavailableError, DataLossError) as exc:
            self._failed(f"did not acknowledge the update: {exc}")

    def _failed(self, why: str) -> None:
        self.error = (f"replica {self.peer.get('name', '?')} at {self.peer.get('host')}:{self.peer.get('port')} "
                      f"{why}")
        self.sock = None


def _ack_timeout(timeout: float, peer: dict) -> float:
    # An acknowledgement comes back through every replica behind ``peer``; each of them may
    # wait one timeout for a stalled downstream, so the wait here is one timeout more than
    # theirs and the replica nearest the fault is the one that names it.
    behind = peer.get("behind", 0)
    return timeout * (2 + (behind if isinstance(behind, int) and 0 <= behind <= 4096 else 0))


def build_topology(metadata: list[dict]) -> tuple[dict, list[dict | None]]:
    """The chain over replicas in the order of ``metadata`` (their :meth:`WeightReceiver.prepare`
    results): the head the sender connects to, and each replica's downstream (None: last).
    Each entry gains ``behind``: how many replicas follow it."""
    if not metadata or not all(isinstance(m, dict) for m in metadata):
        raise InvalidArgumentError("build_topology needs one metadata dict per replica (got none)")
    chain = [dict(m, behind=len(metadata) - 1 - i) for i, m in enumerate(metadata)]
    return chain[0], [*chain[1:], None]
