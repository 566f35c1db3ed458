"""The asyncio client of one worker process (``podium.v1.Worker``).

Used by the controller SDK (on its own event-loop thread) and by workers (to
fetch refs from peers). All methods must be awaited on one event loop.

Calls share one long-lived bidirectional ``Calls`` stream: each call gets a
call id, its frames are written under a lock (one writer at a time) and a
single reader task hands every reply frame to the future of its call id, so
calls overlap freely. When the stream or channel breaks, every pending call
fails at once with UnavailableError naming the rank and address; a call past
its timeout fails with DeadlineExceededError naming the method and rank (and
the worker is told to drop it if it has not started).

Payloads at least ``shm_threshold`` bytes go through a shared-memory segment
when the worker sees this process's /dev/shm (``shm_domain``, learnt from Describe
at :meth:`WorkerClient.start`), both ways, through segments each side reuses
(:mod:`podium.transport.shmpool`); set ``PODIUM_DISABLE_SHM=1`` to keep everything on TCP.
``PODIUM_SHM_THRESHOLD_BYTES`` (default 1 MiB) sets the threshold here and in the
workers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Any

import grpc

from podium import codec, errors, rpc
from podium.transport import frames
from podium.transport import chunks
from podium.transport import shm
from podium.transport import shmpool
from podium.auth import TlsConfig
from podium.refs import ObjectRef
from podium.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["WorkerClient", "Payload", "prepare"]

log = logging.getLogger("podium.worker.client")

_CALL, _CONSTRUCT, _CANCEL = worker_pb2.CALL, worker_pb2.CONSTRUCT, worker_pb2.CANCEL
_DEFAULT_SHM_THRESHOLD = 1 << 20
#: The largest reply a client assembles (a bound against a misbehaving peer).
MAX_REPLY_BYTES = 1 << 40


class Payload:
    """An encoded call payload, prepared once and sendable to many workers.

    With ``reusable`` (what :func:`prepare` makes) the chunk ``bytes`` are made
    on first use and kept for every later worker, so a shard several ranks
    receive is encoded and copied once. A one-shot payload streams its chunks
    instead, so a huge argument is never held twice.
    """

    __slots__ = ("encoded", "nbytes", "reusable", "_chunks", "_tails")

    def __init__(self, encoded: codec.Encoded, reusable: bool = True) -> None:
        self.encoded = encoded
        self.nbytes = encoded.nbytes
        self.reusable = reusable
        self._chunks: list[bytes] | None = None
        self._tails: dict | None = None

    def frame_tail(self, method: str, hold: bool, timeout: float, reply_in_shm: bool) -> bytes:
        """The serialized one-frame CALL of this payload minus its call id (see
        :mod:`podium.transport.frames`); kept for the next call with the same options."""
        key = (method, hold, timeout, reply_in_shm)
        tails = self._tails
        if tails is not None:
            tail = tails.get(key)
            if tail is not None:
                return tail
        tail = frames.call_frame_tail(_CALL, method, self.iter_chunks()[0], hold=hold, timeout=timeout,
                                          reply_in_shm=reply_in_shm)
        if self.reusable and self.nbytes <= frames.TAIL_MAX_BYTES:
            if tails is None:
                tails = self._tails = {}
            if len(tails) < frames.MAX_TAILS:
                tails[key] = tail
        return tail

    def iter_chunks(self):
        """The wire form as chunk-sized ``bytes`` (at least one, the last one marked by the caller)."""
        if self._chunks is not None:
            return self._chunks
        segments = self.encoded.to_segments()
        if self.nbytes <= chunks.CHUNK_SIZE:
            self._chunks = [b"".join(segments)]
            return self._chunks
        if self.reusable:
            self._chunks = [bytes(chunk) for chunk in chunks.iter_chunks(segments)]
            return self._chunks
        return (bytes(chunk) for chunk in chunks.iter_chunks(segments))

    def segments(self) -> list[memoryview]:
        """The wire form as zero-copy segments (for shared memory)."""
        return self.encoded.to_segments()


def _shares_shm(info: worker_pb2.DescribeResponse) -> bool:
    """Whether the described worker sees this process's /dev/shm (see shm.domain)."""
    mine = shm.domain()
    return bool(mine) and info.shm_domain == mine


def prepare(value: Any) -> Payload:
    """Encode ``value`` once into a :class:`Payload` (for :meth:`WorkerClient.call_encoded`)."""
    return Payload(codec.encode(value))


class _Pending:
    """One call waiting for its reply: an asyncio future, or a sink (see submit_into)."""

    __slots__ = ("future", "sink", "on_error", "method", "assembler", "deadline", "timeout", "shm_name",
                 "shm_pooled", "decode")

    def __init__(self, future: asyncio.Future | None, method: str) -> None:
        self.future = future
        #: With ``future`` None: settled by ``sink._set_result(value)`` or ``on_error(sink, exc)``.
        self.sink: Any = None
        self.on_error: Any = None
        self.method = method
        self.assembler: chunks.Assembler | None = None
        #: loop.time() by which the call must have answered (0: none); see _sweep.
        self.deadline = 0.0
        self.timeout: float | None = None
        #: The call's argument segment: unlinked by the worker when it maps it, by us
        #: when the call ends otherwise (a worker that died never maps it).
        self.shm_name = ""
        #: shm_name is a segment of the client's pool (podium.transport.shmpool), not a one-shot one.
        self.shm_pooled = False
        #: Resolve with the decoded value (submit) rather than the raw reply.
        self.decode = False

    def done(self) -> bool:
        """Whether the outcome has been delivered (or the awaiting caller went away)."""
        return self.future.done() if self.future is not None else self.sink.done()

    def resolve(self, value: Any, exc: BaseException | None) -> None:
        """Deliver the outcome (once; later ones are dropped)."""
        future = self.future
        if future is not None:
            if future.done():
                return
            if exc is None:
                future.set_result(value)
            else:
                future.set_exception(exc)
        elif exc is None:
            self.sink._set_result(value)
        else:
            self.on_error(self.sink, exc)


class WorkerClient:
    """Client of one worker: calls over a shared stream, plus Describe/Fetch/Release/Shutdown."""

    def __init__(self, address: str, token: str, *, rank: int = -1, worker_id: str = "",
                 tls: TlsConfig | None = None, shm_threshold: int | None = None) -> None:
        self.address = address
        self.rank = rank
        self.worker_id = worker_id
        if shm_threshold is None:  # the same variable sets the worker's reply threshold
            shm_threshold = int(os.environ.get("PODIUM_SHM_THRESHOLD_BYTES") or _DEFAULT_SHM_THRESHOLD)
        self.shm_threshold = shm_threshold
        #: Whether the worker shares this host (None until known).
        self.same_host: bool | None = False if os.environ.get("PODIUM_DISABLE_SHM") else None
        #: Bytes the last fetch moved (for counters).
        self.last_fetch_bytes = 0
        #: Payloads that went through shared memory, each way (tests check the path taken).
        self.stats = {"shm_sent": 0, "shm_received": 0}
        self._token = token
        self._tls = tls
        self._metadata = rpc.token_metadata(token)
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self._stream = None
        self._reader: asyncio.Task | None = None
        #: The raw call connection (podium.transport.callsocket) when the worker offers one; else the
        #: calls take the gRPC stream above.
        self._raw = None
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._lock: asyncio.Lock | None = None
        self._broken: errors.PodiumError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Reused shared-memory segments, both ways (made in start() for a same-host worker).
        self._shm: shmpool.SharedSegments | None = None
        # One timer for every pending call's deadline, armed at the earliest (see _sweep).
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_at = 0.0

    @property
    def broken(self) -> errors.PodiumError | None:
        """The error that ended the call stream (every later call raises it), or None."""
        return self._broken

    @property
    def pending(self) -> int:
        """Calls sent and not yet answered."""
        return len(self._pending)

    def _who(self) -> str:
        return f"worker rank {self.rank} at {self.address}" if self.rank >= 0 else f"worker at {self.address}"

    # ---------------------------------------------------------------- lifecycle

    def connect(self) -> None:
        """Open the channel (no RPC); enough for describe/fetch/release/shutdown."""
        if self._channel is not None:
            return
        self._loop = asyncio.get_running_loop()
        # The token goes in per-call metadata rather than through a client
        # interceptor: intercepted streams add a queue and a task per message.
        self._channel = rpc.make_channel(self.address, "", self._tls, add_token=False)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def start(self, timeout: float | None = 30.0) -> worker_pb2.DescribeResponse:
        """Connect, learn whether the worker shares this host, open the call stream.

        Returns the worker's Describe answer.
        """
        self.connect()
        info = await self.describe(timeout=timeout)
        if self._stream is not None or self._raw is not None:  # already started: just the fresh Describe
            return info
        if self.same_host is None:
            self.same_host = _shares_shm(info)
        if self.same_host:
            self._shm = shmpool.SharedSegments(self._loop, worker_pb2.CallFrame, self._send_quietly)
        if self.rank < 0:
            self.rank = info.rank
        self.worker_id = self.worker_id or info.worker_id
        self._lock = asyncio.Lock()
        if info.call_port and self._tls is None and os.environ.get("PODIUM_RAW_CALLS", "1") != "0":
            from podium.transport import callsocket

            host = self.address.rsplit(":", 1)[0]
            try:
                self._raw = await callsocket.connect(host, info.call_port, self._token,
                                                  worker_pb2.ReplyFrame.FromString, self._on_raw_frame,
                                                  self._on_raw_lost, timeout=timeout)
            except errors.AuthenticationError:
                raise
            except (OSError, asyncio.TimeoutError, errors.PodiumError) as exc:
                # Unreachable raw port (a firewall between nodes): the gRPC stream works too.
                log.warning("raw call port of %s unusable (%s); using the gRPC stream", self._who(), exc)
                self._raw = None
            if self._raw is not None:
                return info
        self._stream = self._stub.Calls(metadata=self._metadata)
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        return info

    def _on_raw_frame(self, frame: worker_pb2.ReplyFrame) -> None:
        self._on_frame(frame)

    def _on_raw_lost(self, exc: BaseException | None) -> None:
        if self._raw is None:  # lost while connecting: start() reports it (or uses gRPC)
            return
        if isinstance(exc, errors.PodiumError) and not isinstance(exc, errors.DataLossError):
            self._fail_all(exc)
            return
        self._fail_all(errors.UnavailableError(
            f"lost the call connection to {self._who()}: {exc or 'closed by the worker'}", rank=self.rank))

    async def close(self) -> None:
        """Fail pending calls, close the stream and the channel."""
        self._fail_all(errors.UnavailableError(f"client of {self._who()} closed", rank=self.rank))
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        if self._raw is not None:
            self._raw.close()
        if self._stream is not None:
            self._stream.cancel()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass
        if self._channel is not None:
            await self._channel.close()
        if self._shm is not None:
            self._shm.close()
        self._channel = self._stub = self._stream = self._reader = self._raw = None

    # ---------------------------------------------------------------- reader

    async def _read_loop(self) -> None:
        stream = self._stream
        try:
            while True:
                frame = await stream.read()
                if frame is grpc.aio.EOF:
                    raise errors.UnavailableError(f"{self._who()} ended the call stream",
                                                  rank=self.rank)
                self._on_frame(frame)
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
        pending, self._pending = self._pending, {}
        for p in pending.values():
            self._drop_segment(p)
            p.resolve(None, exc)

    def _on_frame(self, frame: worker_pb2.ReplyFrame) -> None:
        if self._shm is not None and (frame.shm_released or frame.shm_forget):
            self._shm.on_frame(frame)
        p = self._pending.get(frame.call_id)
        if p is None:  # a call that already timed out or was cancelled (or call id 0)
            if frame.HasField("header") and frame.header.shm_name:
                self._discard_reply(_ShmReply.of(frame.header))
            return
        if frame.HasField("header"):
            header = frame.header
            if not header.ok:
                self._finish(frame.call_id, p, exc=rpc.error_from_info(header.error))
                return
            if header.HasField("ref"):
                r = header.ref
                self._finish(frame.call_id, p, ObjectRef(r.object_id, r.worker_id, r.owner_address,
                                                         r.owner_rank, r.size_bytes, r.rows,
                                                         r.inline_value or None))
                return
            if header.shm_name:
                self._finish(frame.call_id, p, _ShmReply.of(header))
                return
            if frame.last:
                self._finish(frame.call_id, p, frame.data)
                return
            try:
                p.assembler = chunks.Assembler(header.payload_size, MAX_REPLY_BYTES)
            except errors.PodiumError as exc:
                self._finish(frame.call_id, p, exc=exc)
                return
        if p.assembler is None:
            self._finish(frame.call_id, p, exc=errors.DataLossError(
                f"reply data for call {frame.call_id} without a header from {self._who()}"))
            return
        try:
            p.assembler.add(frame.data)
            if frame.last:
                self._finish(frame.call_id, p, p.assembler.result())
        except errors.PodiumError as exc:
            self._finish(frame.call_id, p, exc=exc)

    def _finish(self, call_id: int, p: _Pending, value: Any = None, exc: BaseException | None = None) -> None:
        del self._pending[call_id]
        # A pooled argument comes back in shm_released instead.
        if p.shm_name and (exc is not None or not p.shm_pooled):
            self._drop_segment(p)
        if p.done():
            if isinstance(value, _ShmReply):
                self._discard_reply(value)
            return
        if exc is None and p.decode:
            try:
                value = self._decode_reply(value)
            except Exception as error:  # noqa: BLE001 - a reply that does not decode fails its call
                exc = error
        p.resolve(value, exc)

    def _watch_deadline(self, p: _Pending, timeout: float) -> None:
        """Give ``p`` a deadline ``timeout`` seconds from now.

        One timer per client, armed at the earliest deadline, replaces a timer per call: a
        burst's calls share a timeout, so arming happens for the first call only.
        """
        deadline = p.deadline = self._loop.time() + timeout
        p.timeout = timeout
        if self._deadline_timer is None or deadline < self._deadline_at:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._deadline_at = deadline
            self._deadline_timer = self._loop.call_at(deadline, self._sweep)

    def _sweep(self) -> None:
        """Expire every call past its deadline; re-arm for the earliest one left."""
        self._deadline_timer = None
        now = self._loop.time()
        earliest = 0.0
        for call_id, p in list(self._pending.items()):
            if not p.deadline:
                continue
            if p.deadline <= now:
                self._expire(call_id)
            elif not earliest or p.deadline < earliest:
                earliest = p.deadline
        if earliest:
            self._deadline_at = earliest
            self._deadline_timer = self._loop.call_at(earliest, self._sweep)

    def _expire(self, call_id: int) -> None:
        p = self._pending.pop(call_id, None)
        if p is None or p.done():
            return
        self._drop_segment(p)
        p.resolve(None, errors.DeadlineExceededError(
            f"call {p.method!r} to {self._who()} did not answer within {p.timeout} s",
            rank=self.rank, details={"method": p.method}))
        # Tell the worker to drop it if it has not started (best effort).
        self._loop.create_task(self._send_cancel(call_id))

    async def _send_cancel(self, call_id: int) -> None:
        try:
            await self._write(worker_pb2.CallFrame(call_id=call_id,
                                                   header=worker_pb2.CallHeader(kind=_CANCEL), last=True))
        except Exception:  # noqa: BLE001 - the stream is gone: nothing to cancel
            pass

    # ---------------------------------------------------------------- calls

    async def _write(self, frame: worker_pb2.CallFrame) -> None:
        raw = self._raw
        if raw is not None:  # buffered by the transport, in call order; wait only when it is full
            raw.write_nowait(frame)
            if raw.must_drain:
                await raw.drain()
            return
        async with self._lock:
            await self._stream.write(frame)

    async def _roundtrip(self, kind: int, method: str, payload: Payload, hold: bool,
                         timeout: float | None) -> Any:
        if self._broken is not None:
            raise self._broken
        if self._stream is None and self._raw is None:
            raise errors.FailedPreconditionError(f"client of {self._who()} is not started")
        call_id = next(self._ids)
        future = self._loop.create_future()
        p = _Pending(future, method)
        self._pending[call_id] = p
        if timeout is not None:
            self._watch_deadline(p, timeout)
        same_host = self.same_host is True
        header = worker_pb2.CallHeader(kind=kind, method=method, payload_size=payload.nbytes,
                                       hold_result=hold, timeout_seconds=timeout or 0.0,
                                       reply_in_shm=same_host)
        try:
            name = ""
            if same_host and payload.nbytes >= self.shm_threshold:
                copy = asyncio.ensure_future(asyncio.to_thread(self._write_shm, payload))
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
                await self._write(worker_pb2.CallFrame(call_id=call_id, header=header, last=True))
            else:
                chunks = iter(payload.iter_chunks())
                chunk = next(chunks)
                first = header
                for following in chunks:
                    if future.done():
                        break  # timed out or failed while sending
                    await self._write(worker_pb2.CallFrame(call_id=call_id, header=first, data=chunk))
                    first, chunk = None, following
                else:
                    await self._write(worker_pb2.CallFrame(call_id=call_id, header=first, data=chunk,
                                                           last=True))
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
                self._loop.create_task(self._send_cancel(call_id))
            raise
        return self._decode_reply(reply)

    def _decode_reply(self, reply: Any) -> Any:
        if isinstance(reply, ObjectRef):
            return reply
        if isinstance(reply, _ShmReply):
            self.stats["shm_received"] += 1
            return codec.decode(self._read_shm(reply))
        return codec.decode(reply)

    # ---------------------------------------------------------------- shared memory

    def _write_shm(self, payload: Payload) -> tuple[str, bool]:
        """(segment name, pooled) holding ``payload``, or ("", False) to send it over TCP.

        Runs on a worker thread: the copy does not hold the loop."""
        try:
            if self._shm is not None:
                name = self._shm.pool.write(payload.segments(), payload.nbytes)
                if name:
                    return name, True
            return shm.write_segments(payload.segments())[0], False
        except OSError:  # /dev/shm full or missing: send over TCP instead
            return "", False

    def _read_shm(self, reply: "_ShmReply") -> memoryview:
        if reply.pooled:
            if self._shm is None:
                raise errors.DataLossError(f"{self._who()} sent a pooled segment to a client without shm")
            return self._shm.cache.read(reply.name, reply.nbytes, MAX_REPLY_BYTES)
        return shm.read_segment(reply.name, max_size=MAX_REPLY_BYTES)

    def _discard_reply(self, reply: "_ShmReply") -> None:
        # A reply nobody waits for: a one-shot segment is removed; a pooled one is mapped
        # and let go at once, which gives it back to the worker's pool.
        if not reply.pooled:
            shm.remove_segment(reply.name)
            return
        try:
            self._read_shm(reply)
        except errors.PodiumError:
            pass

    def _drop_written(self, copy: asyncio.Future, p: _Pending) -> None:
        if not copy.cancelled() and copy.exception() is None:
            p.shm_name, p.shm_pooled = copy.result()
            self._drop_segment(p)

    def _drop_segment(self, p: _Pending) -> None:
        # A one-shot argument is unlinked by the worker when it maps it, so this is a
        # no-op after a normal call; after a failed one it keeps a dead worker's input
        # from leaking. A pooled argument of a failed call is never written again.
        if not p.shm_name:
            return
        if p.shm_pooled and self._shm is not None:
            self._shm.pool.abandon(p.shm_name)
        else:
            shm.remove_segment(p.shm_name)
        p.shm_name = ""

    def _send_quietly(self, frame: worker_pb2.CallFrame) -> None:
        # Segment bookkeeping (on the loop): lost with a broken connection, as its pool is.
        if self._broken is not None:
            return
        if self._raw is not None:
            try:
                self._raw.write_nowait(frame)
            except errors.PodiumError:
                pass
        elif self._stream is not None:
            self._loop.create_task(self._write_quietly(frame))

    async def _write_quietly(self, frame: worker_pb2.CallFrame) -> None:
        try:
            await self._write(frame)
        except Exception:  # noqa: BLE001 - the stream broke: the pool goes with it
            pass

    def submit(self, method: str, payload: Payload, *, hold: bool = False,
               timeout: float | None = None) -> asyncio.Future:
        """Start a call and return a future of its value (or ObjectRef with ``hold``).

        On the raw call connection a payload of one frame is written right here, with no
        coroutine or task per call (the group's fan-out to N ranks is N of these); anything
        else runs :meth:`call_encoded` as a task. Must be called on the client's loop.
        """
        if not self._fast_path_for(payload):
            return self._loop.create_task(self._roundtrip(_CALL, method, payload, hold, timeout))
        future = self._loop.create_future()
        self._send_one_frame(_Pending(future, method), method, payload, hold, timeout)
        return future

    def submit_into(self, method: str, payload: Payload, sink: Any, on_error: Any, *, hold: bool = False,
                    timeout: float | None = None) -> None:
        """Start a call whose outcome settles ``sink`` instead of a future.

        ``sink._set_result(value)`` (the ObjectRef with ``hold``) on success, else
        ``on_error(sink, exc)``; both on the client's loop. ``sink.done()`` says whether it
        still wants an outcome. No asyncio future, task or callback per call: what a burst
        of ``blocking=False`` calls needs. Must be called on the client's loop.
        """
        if not self._fast_path_for(payload):
            task = self._loop.create_task(self._roundtrip(_CALL, method, payload, hold, timeout))

            def settle(t: asyncio.Task) -> None:
                if t.cancelled():
                    on_error(sink, errors.CancelledError(f"call {method!r} to {self._who()} was cancelled"))
                elif t.exception() is not None:
                    on_error(sink, t.exception())
                else:
                    sink._set_result(t.result())

            task.add_done_callback(settle)
            return
        p = _Pending(None, method)
        p.sink = sink
        p.on_error = on_error
        self._send_one_frame(p, method, payload, hold, timeout)

    def _fast_path_for(self, payload: Payload) -> bool:
        """Whether a call with ``payload`` goes out as one raw frame written at once."""
        return (self._raw is not None and self._broken is None and payload.nbytes <= chunks.CHUNK_SIZE
                and not (self.same_host is True and payload.nbytes >= self.shm_threshold))

    def _send_one_frame(self, p: _Pending, method: str, payload: Payload, hold: bool,
                        timeout: float | None) -> None:
        call_id = next(self._ids)
        p.decode = True
        if timeout is not None:
            self._watch_deadline(p, timeout)
        self._pending[call_id] = p
        try:
            if payload.nbytes <= frames.TAIL_MAX_BYTES:
                tail = payload.frame_tail(method, hold, timeout or 0.0, self.same_host is True)
                self._raw.write_serialized_nowait(frames.frame_with_call_id(call_id, tail))
            else:  # one serialization: prefixing a large tail would copy its data again
                header = worker_pb2.CallHeader(kind=_CALL, method=method, payload_size=payload.nbytes,
                                               hold_result=hold, timeout_seconds=timeout or 0.0,
                                               reply_in_shm=self.same_host is True)
                self._raw.write_nowait(worker_pb2.CallFrame(call_id=call_id, header=header,
                                                            data=payload.iter_chunks()[0], last=True))
        except errors.PodiumError as exc:
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

    async def call_encoded(self, method: str, payload: Payload | codec.Encoded, *,
                           hold: bool = False, timeout: float | None = None) -> Any:
        """Like :meth:`call` with an already encoded ``(args, kwargs)`` payload (see :func:`prepare`)."""
        if not isinstance(payload, Payload):
            payload = Payload(payload, reusable=False)
        return await self._roundtrip(_CALL, method, payload, hold, timeout)

    # ---------------------------------------------------------------- unary RPCs

    def _rpc_error(self, exc: grpc.aio.AioRpcError, what: str) -> errors.PodiumError:
        err = rpc.error_from_rpc(exc, what=f"{what} on {self._who()}")
        if type(err) is errors.UnavailableError:
            err = errors.UnavailableError(f"{what}: cannot reach {self._who()}: {exc.details()}",
                                          rank=self.rank)
        elif type(err) is errors.DeadlineExceededError and not exc.trailing_metadata():
            err = errors.DeadlineExceededError(f"{what} on {self._who()} timed out", rank=self.rank)
        return err

    async def describe(self, timeout: float | None = 30.0) -> worker_pb2.DescribeResponse:
        """The worker's identity, state and method table."""
        self.connect()
        try:
            return await self._stub.Describe(worker_pb2.DescribeRequest(), timeout=timeout,
                                             metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc, "Describe") from None

    async def fetch(self, ref: ObjectRef, rows: tuple[int, int] | None = None, *,
                    timeout: float | None = None) -> Any:
        """The value ``ref`` names (or only rows ``[rows[0], rows[1])`` of it), from its owner."""
        self.connect()
        if self.same_host is None and ref.size_bytes >= self.shm_threshold:
            self.same_host = _shares_shm(await self.describe(timeout=timeout or 30.0))
        request = worker_pb2.FetchRequest(object_id=ref.object_id,
                                          reply_in_shm=bool(self.same_host) and ref.size_bytes >= self.shm_threshold)
        if rows is not None:
            request.has_rows = True
            request.row_start, request.row_stop = int(rows[0]), int(rows[1])
        assembler = None
        try:
            async for chunk in self._stub.Fetch(request, timeout=timeout, metadata=self._metadata):
                if assembler is None:
                    if chunk.shm_name:
                        self.last_fetch_bytes = chunk.total_size
                        self.stats["shm_received"] += 1
                        return codec.decode(shm.read_segment(chunk.shm_name, max_size=MAX_REPLY_BYTES))
                    assembler = chunks.Assembler(chunk.total_size, MAX_REPLY_BYTES)
                assembler.add(chunk.data)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc, f"Fetch of {ref.object_id}") from None
        if assembler is None:
            raise errors.DataLossError(f"Fetch of {ref.object_id} from {self._who()} returned nothing")
        self.last_fetch_bytes = assembler.total_size
        return codec.decode(assembler.result())

    async def release(self, object_ids, *, timeout: float | None = 30.0) -> int:
        """Drop held results in the worker; returns how many were held."""
        self.connect()
        ids = [r.object_id if isinstance(r, ObjectRef) else r for r in object_ids]
        try:
            reply = await self._stub.Release(worker_pb2.ReleaseRequest(object_ids=ids),
                                             timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc, "Release") from None
        return reply.released

    async def shutdown(self, reason: str = "", *, timeout: float | None = 10.0) -> None:
        """Ask the worker process to exit (it answers first)."""
        self.connect()
        try:
            await self._stub.Shutdown(worker_pb2.ShutdownRequest(reason=reason), timeout=timeout,
                                      metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc, "Shutdown") from None


class _ShmReply:
    __slots__ = ("name", "pooled", "nbytes")

    def __init__(self, name: str, pooled: bool = False, nbytes: int = 0) -> None:
        self.name = name
        self.pooled = pooled
        self.nbytes = nbytes

    @classmethod
    def of(cls, header: worker_pb2.ReplyHeader) -> "_ShmReply":
        return cls(header.shm_name, header.shm_pooled, header.payload_size)
