"""One client's call stream in a worker: frames in, calls run, replies out.

Serves both the gRPC ``Calls`` stream and the raw call socket (``podium.transport.callsocket``)
through one :class:`~podium.transport.connection.CallConnection`, the same connection layer the
controller's client uses. A one-frame call that the host's admission
(:meth:`~podium.worker.host.admission.CallAdmission.admit`) lets run at once goes straight
to the execution thread (:meth:`CallStream.try_fast`); everything else is assembled here and
run by :meth:`HostRuntime.run_call` / ``run_construct`` as a task. While the stream has
nothing in hand, the execution thread reads the raw socket and runs such calls itself
(:mod:`podium.worker.host.directcalls`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from podium import errors, rpc
from podium.transport import chunks, frames
from podium.transport.callsocket import BulkFrame
from podium.transport.connection import CallConnection
from podium.transport.frames import is_whole_call
from podium.transport.chunks import GrowingAssembler, ReservationBudget
from podium.v1 import worker_pb2
from podium.worker.host.activecall import ActiveCall
from podium.worker.host.admission import Declined
from podium.worker.host.completion import CallCompletion
from podium.worker.host.directcalls import DirectReader
from podium.worker.host.itemstreams import current_connection
from podium.worker.host.results import Outcome
from podium.worker.host.runtime import HostRuntime

__all__ = ["ActiveCall", "CallStream"]

log = logging.getLogger("podium.worker.host")

_CALL, _CONSTRUCT, _CANCEL = frames.CALL, frames.CONSTRUCT, frames.CANCEL


class _Incoming:
    __slots__ = ("header", "assembler")

    def __init__(self, header: worker_pb2.CallHeader, assembler: GrowingAssembler | None) -> None:
        self.header = header
        self.assembler = assembler  # None: discarding the rest of a refused call


class CallStream:
    """One client's Calls stream: assembles CallFrames, runs calls, writes replies."""

    def __init__(self, host: HostRuntime, context: Any) -> None:
        self.host = host
        self.context = context
        self.incoming: dict[int, _Incoming] = {}
        #: Bytes of unfinished payloads this connection may hold (podium.transport.chunks).
        self.budget = ReservationBudget(host.config.max_payload_bytes)
        self.active: dict[int, ActiveCall] = {}
        #: The connection (its segments are used only by a same-host client). Replies written
        #: without awaiting (the fast path) need the raw socket; on the gRPC stream every call
        #: takes the general path.
        self.conn = CallConnection(context, worker_pb2.ReplyFrame, shared_memory=True)
        #: Set while run() waits for the fast-path calls in flight: each one's ending wakes it.
        self.fast_finished: asyncio.Future | None = None
        #: Ends every call of this stream: counts it, records it, picks its reply's writer.
        self.completion = CallCompletion(host.book, self, host.resolved)
        self._end_fast = self.completion.end_fast  # one bound method for every fast call
        self._send_from_thread = self.completion.send_from_thread
        # Frames the execution thread handed back after decoding their payload, with that
        # value (a payload is decoded once: its unpickling may run user code).
        self._declined: collections.deque = collections.deque()
        self._reader: DirectReader | None = None  # made at the first loan (see _lend_reads)
        if self.conn.writes_nowait:
            context.on_idle = self._lend_reads

    async def run(self) -> None:
        """Read frames until the client ends the stream, let calls in flight answer, then clean up."""
        held = False
        current_connection.set(self)  # (the streams this connection reads close with it)
        try:
            async for frame in self.conn.frames():
                if type(frame) is BulkFrame:
                    await self.on_bulk(frame)
                    continue
                if isinstance(frame, rpc.MalformedMessage):  # a peer's garbage bytes
                    await rpc.abort(self.context, frame.error)
                declined = self._declined
                if declined and declined[0][0] is frame:
                    decoded = declined.popleft()[1]
                else:
                    decoded = self.try_fast(frame)
                    if decoded is True:
                        continue
                await self.on_frame(frame, decoded)
                decoded = None  # the call's arguments die with the call, not at the next frame
            # The client half-closed: let the calls in flight answer.
            self.host.exec_thread.hold_prompt(True)
            held = True
            while True:
                tasks = [a.task for a in self.active.values() if a.task is not None and not a.task.done()]
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
                elif any(a.task is None for a in self.active.values()):
                    # fast-path calls (no task): each one that finishes wakes this
                    self.fast_finished = asyncio.get_running_loop().create_future()
                    await self.fast_finished
                else:
                    break
        finally:
            if held:
                self.host.exec_thread.hold_prompt(False)
            self._drop_incoming()  # unfinished payloads go now, not at a later collection
            self.host.streams.connection_ended(self)
            for active in list(self.active.values()):
                if active.job is not None:
                    self.host.exec_thread.cancel(active.job)
                if active.task is not None and not active.task.done():
                    active.task.cancel()
            self.conn.close(carrier=False)  # the socket's owner (or gRPC) closes the carrier

    def _drop_incoming(self) -> None:
        for incoming in self.incoming.values():
            if incoming.assembler is not None:
                incoming.assembler.close()
        self.incoming.clear()

    async def write(self, frame: worker_pb2.ReplyFrame) -> None:
        """Send one reply frame, in order with the others."""
        await self.conn.write(frame)

    def try_fast(self, frame: worker_pb2.CallFrame) -> Any:
        """Hand a one-frame CALL to the execution thread right now when the host's admission
        lets it run at once: no task, gate or future per call; the outcome is written from
        the execution thread or the loop (``CallCompletion.end_fast``). True if started; otherwise
        the decoded payload or None, for on_frame (which also reports every error)."""
        host = self.host
        host.exec_thread.settle()  # calls answered from the execution thread leave `active`
        call_id = frame.call_id
        # (A frame that is not whole goes to on_frame, whose Assembler says what is wrong.)
        if (not self.conn.writes_nowait or not is_whole_call(frame, host.config.max_payload_bytes)
                or call_id in self.active or call_id in self.incoming or self.conn.must_drain):
            return None
        header = frame.header
        fn, value = host.admission.admit(header, frame.data)
        if fn is None:
            return value
        active = ActiveCall(call_id, header, self, None)
        host.stats["calls_in_flight"] += 1  # (CallCompletion.begin, inline: the hot path)
        active.started = time.monotonic()
        self.active[call_id] = active
        args, kwargs = value
        active.job = host.exec_thread.submit_reporting(
            host.invoker.invoke, (fn, args, kwargs, header, self.conn), self._end_fast, active,
            self._send_from_thread)
        return True

    def _lend_reads(self) -> None:
        """The raw socket's ``on_idle``: with nothing of this stream in hand, the execution
        thread reads the socket and answers its fast calls itself (directcalls)."""
        host = self.host
        thread = host.exec_thread
        # (Calls of this stream still queued on the thread run before it reads: in order.)
        if (self.incoming or self._declined or thread.has_reader or thread.holds_reads
                or not host.admission.in_order_now()):
            return
        reader = self._reader
        if reader is None:
            reader = self._reader = DirectReader(self, asyncio.get_running_loop())
        sock = self.conn.carrier.loan.lend_reads(reader.recall)
        if sock is not None:
            reader.start(sock)
            if not thread.lend(reader):  # a streaming call began meanwhile: the loop keeps reading
                reader.let_go()

    def take_back(self, frames: list, decoded: Any, data: bytes) -> None:
        """The execution thread stopped reading (on the loop): ``frames`` and then ``data``
        are this stream's next input; ``decoded``, when not None, is the first frame's
        payload, already decoded (see try_fast)."""
        if decoded is not None:
            self._declined.append((frames[0], decoded))
        self.conn.carrier.loan.take_back(frames, data)

    def direct_done(self, call_id: int, header: worker_pb2.CallHeader, started: float, ok: bool,
                    result: Any, recorded: bool = False) -> None:
        """A call the execution thread read and ran, whose reply it could not send itself
        (an error, a large or shared-memory reply, a busy socket): ended here, on the loop."""
        stats = self.host.stats
        stats["direct_calls"] += 1
        stats["calls_in_flight"] += 1
        active = ActiveCall(call_id, header, self, None)
        active.started = started
        active.recorded = recorded  # the thread put its span on the timeline
        self.active[call_id] = active
        self.completion.end_fast(active, ok, result)

    def reply_later(self, active: ActiveCall, outcome: Outcome) -> None:
        """Send ``outcome`` in chunks (awaited on the gRPC stream), as ``active``'s task."""
        self.spawn(active, self._reply_later(active, outcome))

    async def _reply_later(self, active: ActiveCall, outcome: Outcome) -> None:
        try:
            await self.send_outcome(active.call_id, outcome)
        except Exception:  # noqa: BLE001 - the stream is gone; nobody to tell
            pass
        finally:
            self.active.pop(active.call_id, None)

    def error_frame(self, call_id: int, exc: BaseException) -> worker_pb2.ReplyFrame:
        """The reply frame that answers ``call_id`` with ``exc`` (a non-Podium exception
        becomes InternalError)."""
        if not isinstance(exc, errors.PodiumError):
            log.exception("internal error in call %d", call_id, exc_info=exc)
            exc = errors.InternalError(f"worker host: {type(exc).__name__}: {exc}")
        self.host.with_rank(exc)
        return worker_pb2.ReplyFrame(
            call_id=call_id, header=worker_pb2.ReplyHeader(ok=False, error=rpc.error_info_of(exc)),
            last=True)

    async def send_error(self, call_id: int, exc: BaseException) -> None:
        """Answer ``call_id`` with ``exc`` (a non-Podium exception becomes InternalError)."""
        await self.write(self.error_frame(call_id, exc))

    def reply_nowait(self, call_id: int, outcome: Outcome) -> bool:
        """Queue the whole reply of ``outcome`` on the raw socket if it needs no awaiting
        (one frame, or a bulk frame); False when it must stream in chunks."""
        if outcome.ref is None and not outcome.shm_name and self.conn.takes_bulk(outcome.nbytes):
            self.host.stats["bulk_out"] += 1
            header = outcome.header()
            lent = outcome.lent
            try:
                self.conn.write_bulk_nowait(worker_pb2.ReplyFrame(call_id=call_id, header=header, last=True),
                                            outcome.segments, outcome.nbytes,
                                            None if lent is None else lent.release)
            except BaseException:
                if lent is not None:
                    lent.release()
                raise
            return True
        frame = self.single_frame(call_id, outcome)
        if frame is None:
            return False
        self.conn.write_nowait(frame)
        return True

    def single_frame(self, call_id: int, outcome: Outcome) -> worker_pb2.ReplyFrame | None:
        """The one reply frame of ``outcome``, or None when it streams in chunks."""
        if outcome.ref is not None:
            header = worker_pb2.ReplyHeader(ok=True, ref=outcome.ref)
            frame = worker_pb2.ReplyFrame(call_id=call_id, header=header, last=True)
        elif outcome.shm_name:
            frame = worker_pb2.ReplyFrame(call_id=call_id, header=outcome.header(), last=True)
        elif outcome.nbytes <= chunks.CHUNK_SIZE:
            frame = worker_pb2.ReplyFrame(call_id=call_id, header=outcome.header(),
                                          data=b"".join(outcome.segments), last=True)
        else:
            return None
        return frame

    async def send_outcome(self, call_id: int, outcome: Outcome) -> None:
        """Answer ``call_id`` with a packaged result (the writer picked by ``CallCompletion.send``)."""
        await self.completion.send(call_id, outcome)

    async def on_frame(self, frame: worker_pb2.CallFrame, decoded: Any = None) -> None:
        """Any frame: a cancel, a call's header, or a data chunk (``decoded``: the one-frame
        payload try_fast already decoded, or None)."""
        call_id = frame.call_id
        self.conn.on_bookkeeping(frame)
        if call_id == 0 and not frame.HasField("header"):  # segment bookkeeping only
            return
        if frame.HasField("header"):
            header = frame.header
            self.host.held.release(header.release)  # dropped by the caller; also when refused below
            if header.kind == _CANCEL:
                await self.cancel(call_id)
                return
            if call_id in self.incoming or call_id in self.active:
                await self.send_error(call_id, errors.InvalidArgumentError(
                    f"call id {call_id} is already in use on this stream"))
                return
            if header.kind not in (_CALL, _CONSTRUCT):
                await self.refuse(call_id, header, frame.last, errors.InvalidArgumentError(
                    f"unknown call kind {header.kind}"))
                return
            if header.shm_name:
                if frame.last:
                    self.start(call_id, header, None)
                else:
                    await self.refuse(call_id, header, frame.last, errors.InvalidArgumentError(
                        "a call with shm_name carries no data frames"))
                return
            try:
                # Memory is taken as the data arrives, within the connection's budget.
                assembler = GrowingAssembler(header.payload_size, self.host.config.max_payload_bytes,
                                             self.budget)
            except errors.PodiumError as exc:
                await self.refuse(call_id, header, frame.last, exc)
                return
            incoming = _Incoming(header, assembler)
            if not frame.last:
                self.incoming[call_id] = incoming
        else:
            known = self.incoming.get(call_id)
            if known is None:
                await self.send_error(call_id, errors.DataLossError(
                    f"data frame for call {call_id}, which has no header on this stream"))
                return
            if frame.last:
                del self.incoming[call_id]
            if known.assembler is None:  # the rest of a refused call
                return
            incoming, assembler = known, known.assembler
        try:
            assembler.add(frame.data)
            if frame.last:
                payload = assembler.result()
        except errors.PodiumError as exc:
            assembler.close()
            if not frame.last:
                incoming.assembler = None
            await self.send_error(call_id, exc)
            return
        if frame.last:
            self.start(call_id, incoming.header, payload, decoded)

    async def on_bulk(self, bulk: BulkFrame) -> None:
        """A call whose whole payload came as one bulk frame (raw socket), already in its
        final buffer; refused (the payload dropped) when it was too large."""
        frame = bulk.message
        call_id = frame.call_id
        self.host.held.release(frame.header.release)  # (an absent header has none)
        if not frame.HasField("header") or frame.header.kind not in (_CALL, _CONSTRUCT):
            await self.send_error(call_id, errors.InvalidArgumentError(
                "a bulk frame must carry the header of a CALL or CONSTRUCT"))
        elif call_id in self.incoming or call_id in self.active:
            await self.send_error(call_id, errors.InvalidArgumentError(
                f"call id {call_id} is already in use on this stream"))
        elif bulk.error is not None:
            await self.send_error(call_id, bulk.error)
        else:
            self.host.stats["bulk_in"] += 1
            self.start(call_id, frame.header, bulk.data)

    async def refuse(self, call_id: int, header, last: bool, exc: errors.PodiumError) -> None:
        """Answer a call with ``exc`` and drop the rest of its frames."""
        if not last:
            self.incoming[call_id] = _Incoming(header, None)
        await self.send_error(call_id, exc)

    def start(self, call_id: int, header: worker_pb2.CallHeader, payload: Any, decoded: Any = None) -> None:
        """Start a fully received CALL or CONSTRUCT as a task."""
        host = self.host
        if (decoded is None and header.kind == _CALL and not header.shm_name and not header.refs_segment):
            # A bulk or multi-frame CALL is admitted once its payload is whole, by the same
            # rules (it takes the general path in any case: its payload is large).
            fn, decoded = host.admission.admit(header, payload)
            if fn is not None:  # (admitted to run at once: nothing to materialize, not async)
                decoded = Declined(decoded, (fn, False, False))
        if header.kind == _CALL and host.construct_state == "none":
            active = ActiveCall(call_id, header, self, None)
            self.spawn(active, self.guard(active, self.after_construct(active, payload, decoded)))
            return
        gates = host.admission.reserve_gate()
        active = ActiveCall(call_id, header, self, gates)
        if header.kind == _CONSTRUCT:
            if host.construct_state in ("pending", "done"):
                host.admission.open_gate(*gates)
                self.spawn(active, self.send_error(call_id, errors.FailedPreconditionError(
                    "this worker already has an object (CONSTRUCT runs once)")))
                return
            host.begin_construct()
            body = host.run_construct(active, payload)
        else:
            body = host.run_call(active, payload, decoded)
        self.spawn(active, self.guard(active, body))

    async def after_construct(self, active: ActiveCall, payload: Any, decoded: Any) -> None:
        """A CALL that came before any CONSTRUCT: started, in arrival order, behind the
        CONSTRUCT once it is here (or refused by ``run_call``'s precondition after the wait)."""
        await self.host.construct_arrival()
        active.gates = self.host.admission.reserve_gate()
        await self.host.run_call(active, payload, decoded)

    def spawn(self, active: ActiveCall, coro) -> None:
        """Run ``coro`` as ``active``'s task."""
        self.active[active.call_id] = active
        active.task = asyncio.get_running_loop().create_task(coro)

    async def guard(self, active: ActiveCall, body) -> None:
        """Run a call's body, turn its exception into an error reply, end it (CallCompletion)."""
        completion = self.completion
        completion.begin()
        started = time.monotonic()
        ok = True
        try:
            await body
        except asyncio.CancelledError:
            ok = False
            raise
        except BaseException as exc:  # noqa: BLE001 - becomes the call's error reply
            ok = False
            try:
                await self.send_error(active.call_id, exc)
            except Exception:  # noqa: BLE001 - the stream is gone; nobody to tell
                pass
        finally:
            self.active.pop(active.call_id, None)
            completion.end_general(active, started, ok, self.host.resolved(active.header.method))

    async def cancel(self, call_id: int) -> None:
        """CANCEL: drop a call still arriving or not yet started."""
        incoming = self.incoming.get(call_id)
        if incoming is not None and incoming.assembler is not None:
            incoming.assembler.close()
            incoming.assembler = None  # drop what arrived and what is still coming
            await self.send_error(call_id, errors.CancelledError(f"call {call_id} cancelled"))
            return
        active = self.active.get(call_id)
        if active is None:
            return
        active.cancelled = True
        if active.job is not None:
            self.host.exec_thread.cancel(active.job)  # only succeeds when it has not started
