"""The asyncio client of one worker process (``podium.v1.Worker``), for the controller (on its
loop thread) and for workers fetching refs from peers. All methods run on one event loop.

Calls share one long-lived call connection (the raw call socket, else the gRPC ``Calls``
stream): each call gets a call id, and one reader hands every reply frame to its call
(:class:`~podium.worker.caller.replydecoder.ReplyDecoder`), so calls overlap freely. A broken
connection fails every pending call at once with UnavailableError naming the rank and address;
a call past its timeout fails with DeadlineExceededError (and the worker is told to drop it if
it has not started). Payloads of at least ``shm_threshold`` bytes (``PODIUM_SHM_THRESHOLD_BYTES``,
default 1 MiB, here and in the workers) go through reused shared-memory segments when the
worker sees this process's /dev/shm (learnt at :meth:`WorkerClient.start`);
``PODIUM_DISABLE_SHM=1`` keeps everything on TCP.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable

import grpc

from podium import codec, errors, rpc
from podium.auth import TlsConfig
from podium.refs import ObjectRef
from podium.transport import frames, shm, shmstage
from podium.transport.connection import CallConnection
from podium.transport.payload import Payload, Written, prepare, shares_shm
from podium.v1 import worker_pb2
from podium.worker.caller.channel import RELEASE_PER_CALL, WorkerChannel
from podium.worker.host.config import FETCH_CALL
from podium.worker.caller.pendingcalls import PendingCall, PendingCalls, Sink
from podium.worker.caller.replydecoder import FailedReply, InPlaceReply, ReplyDecoder, ShmReply

__all__ = ["WorkerClient", "Payload", "prepare"]

log = logging.getLogger("podium.worker.caller.client")

_CALL, _CONSTRUCT, _CANCEL = frames.CALL, frames.CONSTRUCT, frames.CANCEL


class WorkerClient:
    """Client of one worker: calls over one call connection, beside the worker's gRPC
    channel (:attr:`channel`, a :class:`~podium.worker.caller.channel.WorkerChannel`: Describe,
    Timeline, Fetch, Release, Shutdown)."""

    def __init__(self, address: str, token: str, *, rank: int = -1, worker_id: str = "",
                 tls: TlsConfig | None = None, shm_threshold: int | None = None) -> None:
        #: The worker's gRPC channel and its unary RPCs.
        self.channel = channel = WorkerChannel(address, token, rank=rank, worker_id=worker_id, tls=tls,
                                               shm_threshold=shm_threshold)
        # What every call reads, bound once: the channel's own counters and release queue, its
        # threshold, and whether calls may use shared memory (learnt by start(), which tells
        # the channel too; a test may set it to force the TCP path).
        self.stats = channel.stats
        self.releasable = channel.releasable
        self.shm_threshold = channel.shm_threshold
        self.same_host = channel.same_host
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The gRPC ``Calls`` stream and its reader task, when the calls take it.
        self._stream: Any = None
        self._reader: asyncio.Task | None = None
        #: The call connection (raw socket or the stream above), made by start().
        self._conn: CallConnection | None = None
        self._pending = PendingCalls(self._expire)
        #: Reads the reply frames (podium.worker.caller.replydecoder); knows the connection once made.
        self._replies = ReplyDecoder(self._pending, self._finish, self.stats, self._who)
        self._broken: errors.PodiumError | None = None

    # The worker's identity is its channel's (learnt by start() where not given).
    address = property(lambda self: self.channel.address, doc="The worker's gRPC address.")
    rank = property(lambda self: self.channel.rank, doc="The worker's rank (-1 when it has none).")
    worker_id = property(lambda self: self.channel.worker_id, doc="The worker's id.")
    last_fetch_bytes = property(lambda self: self.channel.last_fetch_bytes, doc="Bytes the last fetch moved.")

    def _who(self) -> str:
        return self.channel.who()

    def connect(self) -> None:
        """Open the gRPC channel (no RPC) on the running loop, the loop every call uses."""
        self.channel.connect()
        self._loop = self.channel.loop

    async def describe(self, timeout: float | None = 30.0) -> worker_pb2.DescribeResponse:
        """The worker's identity, state and method table (the channel's Describe)."""
        self.connect()
        return await self.channel.describe(timeout=timeout)

    @property
    def broken(self) -> errors.PodiumError | None:
        """The error that ended the call stream (every later call raises it), or None."""
        return self._broken

    @property
    def pending(self) -> int:
        """Calls sent and not yet answered."""
        return len(self._pending)

    @property
    def transport(self) -> str:
        """Which carrier the calls take: ``"socket"`` (the raw call socket), ``"grpc"`` (the
        ``Calls`` stream, what TLS uses), or ``""`` before :meth:`start`."""
        if self._conn is None:
            return ""
        return "socket" if self._conn.writes_nowait else "grpc"

    @property
    def segments(self) -> Any:
        """The connection's reused shared-memory segments (``pool``: what this side wrote,
        ``cache``: what the worker wrote), or None for a worker on another host."""
        return self._conn.segments if self._conn is not None else None

    async def start(self, timeout: float | None = 30.0) -> worker_pb2.DescribeResponse:
        """Connect, learn whether the worker shares this host, open the call stream.

        Returns the worker's Describe answer.
        """
        self.connect()
        info = await self.describe(timeout=timeout)
        if self._conn is not None:  # already started: just the fresh Describe
            return info
        channel = self.channel
        if self.same_host is None:
            self.same_host = shares_shm(info)
        channel.same_host = self.same_host
        if channel.rank < 0:
            channel.rank = info.rank
        channel.worker_id = channel.worker_id or info.worker_id
        carrier: Any = None
        if info.call_port and os.environ.get("PODIUM_RAW_CALLS", "1") != "0":
            carrier = await channel.open_call_socket(info.call_port, self._replies.on_frame, self._on_raw_lost,
                                                     timeout)
        if carrier is None:
            carrier = self._stream = channel.stub().Calls(metadata=channel.metadata)
        self._conn = self._replies.conn = CallConnection(carrier, worker_pb2.CallFrame,
                                                         shared_memory=bool(self.same_host))
        if self._stream is not None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        return info

    def _on_raw_lost(self, exc: BaseException | None) -> None:
        if self._conn is None:  # lost while connecting: start() reports it (or uses gRPC)
            return
        if isinstance(exc, errors.PodiumError) and not isinstance(exc, errors.DataLossError):
            self._fail_all(exc)
            return
        self._fail_all(errors.UnavailableError(
            f"lost the call connection to {self._who()}: {exc or 'closed by the worker'}", rank=self.rank))

    async def close(self) -> None:
        """Fail pending calls, close the stream and the channel."""
        self._fail_all(errors.UnavailableError(f"client of {self._who()} closed", rank=self.rank))
        self._pending.stop()
        if self._conn is not None:
            self._conn.close()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass
        await self.channel.close()
        self._stream = self._reader = self._conn = self._replies.conn = None

    async def _read_loop(self) -> None:
        assert self._conn is not None
        try:
            async for frame in self._conn.frames():
                self._replies.on_frame(frame)
            raise errors.UnavailableError(f"{self._who()} ended the call stream", rank=self.rank)
        except asyncio.CancelledError:
            raise
        except errors.PodiumError as exc:
            self._fail_all(exc)
        except grpc.aio.AioRpcError as exc:
            self._fail_all(self._stream_error(exc))
        except Exception as exc:  # noqa: BLE001 - any reader failure must release the callers
            self._fail_all(errors.UnavailableError(
                f"call stream to {self._who()} failed: {type(exc).__name__}: {exc}", rank=self.rank))

    def _stream_error(self, exc: grpc.aio.AioRpcError) -> errors.PodiumError:
        err = rpc.error_from_rpc(exc, what=self._who())
        if isinstance(err, (errors.AuthenticationError, errors.PermissionDeniedError)):
            return err
        return errors.UnavailableError(
            f"lost the call stream to {self._who()}: {exc.code().name}: {exc.details()}",
            rank=self.rank)

    def fail_pending(self, exc: errors.PodiumError) -> None:
        """Fail every pending call with ``exc``, and every later call too: the worker is
        known to be gone (the controller's death watch heard it from the scheduler)."""
        self._fail_all(exc)

    def _fail_all(self, exc: errors.PodiumError) -> None:
        if self._broken is None:
            self._broken = exc
        for p in self._pending.take_all():
            self._drop_segment(p)
            p.resolve(None, exc)

    def _finish(self, call_id: int, p: PendingCall, value: Any = None, exc: BaseException | None = None) -> None:
        del self._pending[call_id]
        if type(value) is FailedReply:
            value, exc = None, value.error
        # A pooled argument comes back in shm_released instead; its pin ends here (a reply
        # written in place into it holds views of it by now).
        if exc is not None or (p.shm_name and not p.shm_pooled):
            self._drop_segment(p)
        else:
            if p.shm_name and self._conn is not None:
                self._conn.unpin_segment(p.shm_name)
            if p.staged:
                shmstage.STAGE.unpin(p.staged)
                p.staged = ""
        if p.done():
            if type(value) is InPlaceReply:
                value = value.reply
            if isinstance(value, ShmReply) and self._conn is not None:
                self._conn.discard_segment(value.name, value.pooled, value.nbytes)
            return
        if exc is None and p.decode:
            try:
                value = self._replies.decode(value)
            except Exception as error:  # noqa: BLE001 - a reply that does not decode fails its call
                exc = error
        p.resolve(value, exc)

    def _expire(self, call_id: int) -> None:
        p = self._pending.pop(call_id, None)
        if p is None or p.done():
            return
        self._drop_segment(p)
        p.resolve(None, errors.DeadlineExceededError(
            f"call {p.method!r} to {self._who()} did not answer within {p.timeout} s",
            rank=self.rank, details={"method": p.method}))
        # Tell the worker to drop it if it has not started (best effort).
        self._on_loop().create_task(self._send_cancel(call_id))

    async def _send_cancel(self, call_id: int) -> None:
        try:
            await self._write(worker_pb2.CallFrame(call_id=call_id,
                                                   header=worker_pb2.CallHeader(kind=_CANCEL), last=True))
        except Exception:  # noqa: BLE001 - the stream is gone: nothing to cancel
            pass

    def _on_loop(self) -> asyncio.AbstractEventLoop:
        """The client's loop (set by connect(), which start() runs first)."""
        loop = self._loop
        if loop is None:
            raise errors.FailedPreconditionError(f"client of {self._who()} is not started")
        return loop

    async def _write(self, frame: worker_pb2.CallFrame) -> None:
        assert self._conn is not None
        await self._conn.write(frame)

    async def _roundtrip(self, kind: worker_pb2.CallKind.ValueType, method: str, payload: Payload, hold: bool,
                         timeout: float | None, decode: bool = True, trace: int = 0) -> Any:
        if self._broken is not None:
            raise self._broken
        conn = self._conn
        if conn is None:
            raise errors.FailedPreconditionError(f"client of {self._who()} is not started")
        if payload.copying is not None:  # still being copied: this path reads the copy
            await asyncio.shield(payload.copying.copied)
            payload.copying.check()
        future = self._on_loop().create_future()
        p = PendingCall(future, method)
        call_id = self._pending.add(p, timeout)
        same_host = self.same_host is True
        header = worker_pb2.CallHeader(kind=kind, method=method, payload_size=payload.nbytes,
                                       hold_result=hold, timeout_seconds=timeout or 0.0,
                                       reply_in_shm=same_host, trace_id=trace)
        try:
            segments = conn.segments
            staged = payload.staged if same_host and segments is not None else None
            if staged is not None and segments is not None:
                # Its large buffers are in the group call's staged segment: only the rest goes
                # here, with references (the worker maps the segment itself).
                shmstage.STAGE.sent(staged.name, segments)
                p.staged = staged.name
                header.refs_segment = staged.name
                header.refs.extend(staged.refs)
                header.payload_size = staged.nbytes
                payload = Payload(staged.rest, reusable=False)
            name = ""
            if payload.written is not None:  # copied into our segment when the call returned
                name, p.shm_pooled = payload.written.take(conn)
                if not name:
                    raise errors.UnavailableError(f"cannot send {method!r} to {self._who()}: its connection "
                                                  "changed after the arguments were written", rank=self.rank)
            elif same_host and payload.nbytes >= self.shm_threshold:
                # Pinned: its reply may be views of it (a result computed in place), see _finish.
                copy = asyncio.ensure_future(asyncio.to_thread(conn.write_segment, payload.segments(),
                                                               payload.nbytes, True))
                try:
                    name, p.shm_pooled = await asyncio.shield(copy)
                except asyncio.CancelledError:  # the copy finishes anyway: drop what it wrote
                    copy.add_done_callback(lambda done: self._drop_written(done, p))
                    raise
            if name:
                header.shm_name = name
                header.shm_pooled = p.shm_pooled
                p.shm_name = name
                self.stats["shm_sent"] += 1
                await conn.write(worker_pb2.CallFrame(call_id=call_id, header=header, last=True))
            elif conn.takes_bulk(payload.nbytes):
                self.stats["bulk_sent"] += 1
                await conn.send_bulk(worker_pb2.CallFrame(call_id=call_id, header=header, last=True),
                                     payload.segments(), payload.nbytes)
            else:  # stops early once the call timed out or failed while sending
                await conn.send_chunks(call_id, header, payload.iter_chunks(), stop=future.done)
        except (asyncio.CancelledError, errors.PodiumError):
            self._pending.pop(call_id, None)
            self._drop_segment(p)
            # The connection may have failed the call's future while this was sending (it
            # awaits the shm copy and the writes): the error is raised here instead.
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: no "Future exception was never retrieved"
            raise
        except Exception as exc:  # noqa: BLE001 - a write on a broken stream
            err = self._broken or errors.UnavailableError(
                f"cannot send {method!r} to {self._who()}: {type(exc).__name__}: {exc}", rank=self.rank)
            self._fail_all(err)
            if future.done() and not future.cancelled():
                future.exception()  # raised below instead: not "never retrieved"
            raise err from None
        try:
            reply = await future
        except asyncio.CancelledError:
            if self._pending.pop(call_id, None) is not None:
                self._drop_segment(p)
                self._on_loop().create_task(self._send_cancel(call_id))
            raise
        return self._replies.decode(reply) if decode else reply

    def _drop_written(self, copy: asyncio.Future, p: PendingCall) -> None:
        if not copy.cancelled() and copy.exception() is None:
            p.shm_name, p.shm_pooled = copy.result()
            self._drop_segment(p)

    def _drop_segment(self, p: PendingCall) -> None:
        # The argument segment of a call that ended without the worker taking it.
        if p.staged:
            shmstage.STAGE.abandon(p.staged, self._conn.segments if self._conn is not None else None)
            p.staged = ""
        if not p.shm_name:
            return
        if self._conn is not None:
            self._conn.drop_segment(p.shm_name, p.shm_pooled)
        else:
            shm.remove_segment(p.shm_name)
        p.shm_name = ""

    def submit(self, method: str, payload: Payload, *, hold: bool = False,
               timeout: float | None = None, trace: int = 0) -> asyncio.Future:
        """Start a call and return a future of its value (or ObjectRef with ``hold``).

        On the raw call connection a payload of one frame is written right here, with no
        coroutine or task per call (the group's fan-out to N ranks is N of these); anything
        else runs :meth:`call_encoded` as a task. Must be called on the client's loop.
        """
        if not self._fast_path_for(payload):
            return self._on_loop().create_task(self._roundtrip(_CALL, method, payload, hold, timeout, trace=trace))
        loop = self._loop
        assert loop is not None  # started: _fast_path_for saw its connection
        future = loop.create_future()
        self._send_one_frame(PendingCall(future, method), method, payload, hold, timeout, trace)
        return future

    def snapshot(self, payload: Payload) -> Payload:
        """``payload`` as it is now, for a call to this worker that returns before it is sent
        (:meth:`Payload.snapshot`). One this worker reads from shared memory is written into
        its segment now: the copy sending it makes anyway, so the snapshot costs nothing more.
        One that goes as a bulk frame on plain TCP is copied while it is sent: the caller runs
        its ``copying.run()`` once the call is queued, before returning
        (:meth:`Payload.snapshot_while_sent`). Safe on any thread."""
        conn = self._conn
        if conn is not None and payload.staged is None:
            if self.same_host is True and payload.nbytes >= self.shm_threshold:
                name, pooled = conn.write_segment(payload.segments(), payload.nbytes, True)
                if name:
                    return Written.payload(payload.nbytes, conn, name, pooled)
            elif self._loop is not None and conn.copies_on_send(payload.nbytes):
                return payload.snapshot_while_sent(self._loop)
        return payload.snapshot()

    def submit_into(self, method: str, payload: Payload, sink: Sink, on_error: Callable[[Sink, BaseException], Any], *, hold: bool = False,
                    timeout: float | None = None, trace: int = 0) -> None:
        """Start a call whose outcome settles ``sink`` instead of a future.

        ``sink.set_result(value)`` (the ObjectRef with ``hold``) on success, else
        ``on_error(sink, exc)``; both on the client's loop. ``sink.done()`` says whether it
        still wants an outcome. No asyncio future, task or callback per call: what a burst
        of ``blocking=False`` calls needs. Must be called on the client's loop. ``trace``: the
        group call's id on the timeline (``CallHeader.trace_id``).
        """
        if not self._fast_path_for(payload):
            task = self._on_loop().create_task(self._roundtrip(_CALL, method, payload, hold, timeout, trace=trace))

            def settle(t: asyncio.Task) -> None:
                if t.cancelled():
                    on_error(sink, errors.CancelledError(f"call {method!r} to {self._who()} was cancelled"))
                elif (exc := t.exception()) is not None:
                    on_error(sink, exc)
                else:
                    sink.set_result(t.result())

            task.add_done_callback(settle)
            return
        p = PendingCall(None, method)
        p.sink = sink
        p.on_error = on_error
        self._send_one_frame(p, method, payload, hold, timeout, trace)

    def _fast_path_for(self, payload: Payload) -> bool:
        """Whether a call with ``payload`` goes out as one raw frame written at once."""
        conn = self._conn
        return (conn is not None and conn.writes_nowait and self._broken is None and payload.staged is None
                and not (self.same_host is True and payload.nbytes >= self.shm_threshold))

    def _send_one_frame(self, p: PendingCall, method: str, payload: Payload, hold: bool,
                        timeout: float | None, trace: int = 0) -> None:
        conn = self._conn
        assert conn is not None  # _fast_path_for said so
        p.decode = True
        call_id = self._pending.add(p, timeout)
        releasable = self.releasable
        # Held results whose refs died ride along (at most a frame's worth; the rest wait).
        release = [releasable.popleft() for _ in range(min(len(releasable), RELEASE_PER_CALL))] if releasable else None
        try:
            if payload.nbytes <= frames.TAIL_MAX_BYTES and not conn.takes_bulk(payload.nbytes):
                tail = payload.frame_tail(method, hold, timeout or 0.0, self.same_host is True)
                frame = frames.frame_with_call_id(call_id, tail)
                if trace:
                    frame += frames.trace_suffix(trace)
                if release:
                    frame += frames.release_suffix(release)
                conn.write_serialized_nowait(frame)
            else:  # the payload's own memory, after a header frame (a ONE_TO_ALL shares it)
                self.stats["bulk_sent"] += 1
                header = worker_pb2.CallHeader(kind=_CALL, method=method, payload_size=payload.nbytes,
                                               hold_result=hold, timeout_seconds=timeout or 0.0,
                                               reply_in_shm=self.same_host is True, trace_id=trace,
                                               release=release or ())
                conn.write_bulk_nowait(worker_pb2.CallFrame(call_id=call_id, header=header, last=True),
                                       payload.segments(), payload.nbytes, copying=payload.copying)
        except errors.PodiumError as exc:
            if release:  # not sent: the Releaser's flush takes them
                releasable.extendleft(reversed(release))
            self._pending.pop(call_id, None)
            p.resolve(None, exc)

    async def construct(self, payload_value: Any, *, timeout: float | None = None) -> None:
        """Build the hosted object from ``(cls_or_import_path, args, kwargs)``, a
        ClassWithInitArgs, or a prepared Payload of the former.

        A class that is not importable in the worker is pickled by value. A
        constructor that raised comes back as RemoteError.
        """
        if not isinstance(payload_value, Payload):
            from podium.worker.factory import by_value

            if hasattr(payload_value, "construct_payload"):  # a ClassWithInitArgs
                with by_value(payload_value):
                    payload_value = prepare(payload_value.construct_payload())
            else:
                with by_value(payload_value[0]):
                    payload_value = prepare(tuple(payload_value))
        await self._roundtrip(_CONSTRUCT, "", payload_value, False, timeout)

    async def call(self, method: str, args: Any = (), kwargs: dict | None = None, *,
                   hold: bool = False, timeout: float | None = None) -> Any:
        """Run ``method(*args, **kwargs)`` in the worker; the value, or an ObjectRef with ``hold``."""
        payload = Payload(codec.encode((tuple(args), kwargs or {})), reusable=False)
        return await self._roundtrip(_CALL, method, payload, hold, timeout)

    async def fetch(self, ref: ObjectRef, rows: tuple[int, int] | None = None, *,
                    timeout: float | None = None) -> Any:
        """The value ``ref`` names (or rows of it), from its owner: over the raw call socket
        when the owner serves one (a bulk frame into this process's reused memory), else the
        ``Fetch`` RPC (an owner with no call socket: the controller's object server).
        A client that is not started yet is started here."""
        if self._conn is None and self._broken is None:
            if (await self.describe(timeout=timeout or 30.0)).call_port:  # not an object server
                await self.start(timeout=timeout or 30.0)
        if self.transport != "socket" or self._broken is not None:
            return await self.channel.fetch(ref, rows, timeout=timeout)
        payload = Payload(codec.encode(((ref.object_id, rows), {})), reusable=False)
        reply = await self._roundtrip(_CALL, FETCH_CALL, payload, False, timeout, decode=False)
        self.channel.last_fetch_bytes = reply.nbytes if isinstance(reply, ShmReply) else len(reply)
        return self._replies.decode(reply)

    async def call_encoded(self, method: str, payload: Payload | codec.Encoded, *,
                           hold: bool = False, timeout: float | None = None) -> Any:
        """Like :meth:`call` with an already encoded ``(args, kwargs)`` payload (see :func:`prepare`)."""
        if not isinstance(payload, Payload):
            payload = Payload(payload, reusable=False)
        return await self._roundtrip(_CALL, method, payload, hold, timeout)
