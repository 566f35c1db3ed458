"""The execution thread reading a raw call socket itself while the worker's loop has nothing to do.

On the loop's path a fast call wakes two threads in the worker: the loop reads and parses
the frame and hands the call over, then the execution thread runs it and replies. With
128 workers on 2 cores every wake-up lands on caches that the other processes have just
used, and the hand-over costs more than the call. So while a raw-socket call stream has
nothing in hand (no call in flight, no bytes or frames held), its loop lends the socket's
read side to the execution thread (``ThreadLoan.lend_reads``): between jobs the
thread waits in ``poll()`` on the socket and on its own wake-up pipe, and runs each fast
call that the host's admission lets run at once
(:meth:`~podium.worker.host.admission.CallAdmission.admit`, the same rules as the loop's) as it reads it, in order, replying from
the thread. One thread wakes per call; the loop sleeps.

A CANCEL read here drops the call it names if that call is still waiting in this
reader's buffer (before the thread runs the next call it reads what arrived meanwhile),
as the loop would drop a queued job. The first frame of any other kind (a bulk or
multi-frame payload, a call the general path must run, bookkeeping, bytes that do not
parse) ends the loan: it and everything read after it go back to the loop
(``ThreadLoan.take_back``), which takes them as if it had read them itself. So does
the end of the stream, and the loop recalls the loan when the connection ends. Replies
that cannot leave from this thread (an error, a bulk or shared-memory reply, a busy
socket) are written by the loop (:meth:`CallStream.direct_done`). Either way the call
ends in :class:`~podium.worker.host.completion.CallCompletion`.

Calls read together (a pipelined burst) have their replies sent together: a reply waits
for the next call held here only when that call's method last ran in under 0.2 ms, so one
send carries a burst's replies and a reply never waits for a call that may be slow.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import select
import socket
import time
from collections.abc import Callable
from time import monotonic
from typing import Any, Protocol

from podium import errors
from podium.borrows import BORROWS
from podium.tracering import RING
from podium.transport.frames import BULK_FLAG, CANCEL, FRAME_LENGTH, is_whole_call
from podium.v1 import worker_pb2
from podium.transport.connection import CallConnection
from podium.worker.host.completion import CallCompletion, reply_frame
from podium.worker.host.runtime import HostRuntime

__all__ = ["DirectReader", "DirectStream"]

log = logging.getLogger("podium.worker.host")

_LEN = FRAME_LENGTH
_BULK_FLAG = BULK_FLAG
_CANCEL = CANCEL
_parse_frame = worker_pb2.CallFrame.FromString
# Frames are read into a buffer of this size, with at least _ROOM free for each read: a
# frame larger than the difference goes to the loop (its payload is large anyway).
_BUFFER = 256 << 10
_ROOM = 64 << 10
_MAX_HERE = _BUFFER - _ROOM - 4
# poll() returns this often with nothing to do (a lost wake-up costs at most this).
_POLL_MS = 1000
# Ends the frames this reader takes: that frame and all after it go to the loop.
_FOR_LOOP = object()
# A reply waits for the next call's (to leave in one send) only when that call's method
# last ran under this long, and at most this many wait: a slow call never holds another's reply.
_QUICK_S = 0.0002
_MAX_UNSENT = 64
# Methods whose last run time is kept (a class that answers any name must not grow it).
_MAX_METHODS = 1024


class DirectStream(Protocol):
    """What a :class:`DirectReader` needs of the call stream whose socket it reads (a
    ``CallStream``): its host and connection, and the loop-side ends of a loan."""

    @property
    def host(self) -> HostRuntime:
        """The worker host the calls run in."""

    @property
    def conn(self) -> CallConnection:
        """The stream's call connection."""

    @property
    def completion(self) -> CallCompletion:
        """What ends the stream's calls (counts them, records them)."""

    def take_back(self, frames: list, decoded: Any, data: bytes) -> None:
        """The socket comes back to the loop with what was read and not run (on the loop)."""

    def direct_done(self, call_id: int, header: worker_pb2.CallHeader, started: float, ok: bool,
                    result: Any, recorded: bool = False) -> None:
        """Answer, on the loop, a call run here whose reply did not go from the thread
        (``recorded``: its span is on the timeline already)."""


class DirectReader:
    """One raw call socket's read side, lent to the execution thread (see the module
    docstring); a stream keeps one for all its loans. :meth:`start` and :meth:`recall` run
    on the loop, the rest on the thread."""

    def __init__(self, stream: DirectStream, loop: asyncio.AbstractEventLoop) -> None:
        self.stream = stream
        self._host = stream.host
        self._thread = stream.host.exec_thread
        self._loop = loop
        self._sock: socket.socket | None = None
        self.recalled = False
        self._eof = False
        self._buffer = bytearray(_BUFFER)
        self._view = memoryview(self._buffer)  # (never resized: moving bytes keeps its length)
        self._start = self._end = 0
        # Parsed and not run yet, in order: CallFrames, perhaps ended by _FOR_LOOP (whose
        # bytes still lie in the buffer from _start).
        self._frames: collections.deque = collections.deque()
        self._poll = select.poll()
        self._poll.register(self._thread.wake_fd, select.POLLIN)
        self._max_payload = stream.host.config.max_payload_bytes
        # Replies of calls run here and not sent yet: (framed reply, frame, started, outcome,
        # seconds). Kept only while the next call held here is a quick one, so a burst of
        # calls costs one send, not one per call.
        self._unsent: list[tuple] = []
        #: Whether each method's last run here took under _QUICK_S.
        self._quick: dict[str, bool] = {}
        # Whether the socket's send buffer is full (read per call: the connection's own flag).
        self._writer = stream.conn.carrier.writer
        # Bound once: on the hot path every attribute hop is paid per call.
        self._write_frames = stream.conn.carrier.loan.write_frames_from_thread
        self._conn = stream.conn
        self._admit = stream.host.admission.admit
        self._invoke = stream.host.invoker.invoke
        self._book = stream.host.book
        self._end_call = stream.completion.end_on_thread
        self._unsent_on_thread = stream.completion.unsent_on_thread

    def start(self, sock: socket.socket) -> None:
        """Take the socket lent (on the loop, before ``ExecutionThread.lend``)."""
        self.recalled = self._eof = False
        self._sock = sock
        self._poll.register(sock.fileno(), select.POLLIN)

    def recall(self) -> None:
        """Ask for the socket back (on the loop): the thread lets go at its next step."""
        self.recalled = True
        self._thread.wake()

    def serve(self, idle: Callable[[], bool]) -> None:
        """Serve the socket while ``idle()`` (no job waits for the thread): wait for a frame
        or a wake-up (at most a second at a time), run what came, and again. Returns once a
        job waits or the socket went back to the loop. (One loop for a run of calls, not a
        return to the thread's job loop after each: at scale each step costs.)"""
        poll, wake_fd = self._poll.poll, self._thread.wake_fd
        try:
            while idle():
                readable = False
                for fd, _ in poll(_POLL_MS):
                    if fd != wake_fd:
                        readable = True
                        continue
                    try:
                        while len(os.read(fd, 4096)) == 4096:
                            pass
                    except BlockingIOError:  # emptied
                        pass
                if self.recalled:
                    self.let_go()
                    return
                if readable and self._read():
                    self._run()
                if self._sock is None:
                    return
        except Exception:  # noqa: BLE001 - a bug here must not end the execution thread
            log.exception("reading the call socket on the execution thread failed; the loop takes it back")
            self.let_go()

    def let_go(self, decoded: Any = None) -> None:
        """Hand the socket back to the loop with the frames not run and the bytes after
        them (``decoded``: the first frame's payload, when it was decoded)."""
        self._send_unsent()
        sock = self._sock
        if sock is None:
            return
        self._sock = None
        self._poll.unregister(sock.fileno())
        self._thread.release()
        frames = [frame for frame in self._frames if frame is not _FOR_LOOP]
        self._frames.clear()
        data = bytes(self._buffer[self._start:self._end])
        self._start = self._end = 0
        try:
            self._loop.call_soon_threadsafe(self.stream.take_back, frames, decoded, data)
        except RuntimeError:  # the loop is closed: nobody reads any more
            pass
        sock.close()  # the loop's own descriptors keep the socket open

    def _read(self) -> bool:
        """Take what the socket holds now, without waiting; False once the socket went back.
        At its end (the peer closed it or it failed) the calls held here still run; then
        the loop reads the socket again and meets that end itself."""
        start, end = self._start, self._end
        if start == end:  # everything read was taken: read into the front again
            self._start = self._end = end = 0
        elif _BUFFER - end < _ROOM:
            buffer, pending = self._buffer, end - start
            buffer[:pending] = buffer[start:end]
            self._start, self._end = 0, pending
            end = pending
        if self._eof or _BUFFER - end < _ROOM:
            return True  # (no room: the bytes held begin a frame for the loop, which reads the rest)
        sock = self._sock
        if sock is None:  # (handed back already)
            return False
        try:
            count = sock.recv_into(self._view[end:])
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            count = 0
        if not count:  # the calls held still run (a client may half-close after sending)
            self._eof = True
            if not self._frames:
                self.let_go()
                return False
            return True
        self._end += count
        self._parse()
        return True

    def _parse(self) -> None:
        frames = self._frames
        if frames and frames[-1] is _FOR_LOOP:
            return
        buffer, view, pos, end = self._buffer, self._view, self._start, self._end
        while end - pos >= 4:
            (length,) = _LEN.unpack_from(buffer, pos)
            if length & _BULK_FLAG or length > _MAX_HERE:
                frames.append(_FOR_LOOP)
                break
            stop = pos + 4 + length
            if stop > end:
                break
            try:  # (parsed from the view: one copy, not two)
                frame = _parse_frame(bytes(view[pos + 4:stop]))
            except Exception:  # noqa: BLE001 - the loop parses it again and ends the connection
                frames.append(_FOR_LOOP)
                break
            # Taken here: a CALL whose one frame carries its whole payload (as try_fast asks),
            # or a plain CANCEL of a call held here. Anything else is the loop's.
            if is_whole_call(frame, self._max_payload):
                frames.append(frame)
            elif frame.header.kind == _CANCEL:  # (CANCEL is not 0: the frame has a header)
                if not (frame.last and not frame.shm_released and not frame.shm_forget
                        and self._cancel(frame.call_id)):
                    frames.append(_FOR_LOOP)  # a call the loop holds, or one that ran: the loop's to answer
                    break
            else:
                frames.append(_FOR_LOOP)
                break
            pos = stop
        self._start = pos

    def _cancel(self, call_id: int) -> bool:
        """Drop the call ``call_id`` if it waits here (True)."""
        for frame in self._frames:
            if frame.call_id == call_id:
                self._frames.remove(frame)
                self._report(call_id, frame.header, time.monotonic(), False,
                             errors.CancelledError("cancelled before it started"))
                return True
        return False

    def _run(self) -> None:
        """Run the calls held, in order, until none is left or one is the loop's.

        The hot path of a worker at scale: each call here costs one admission, the method,
        one row of counters and a reply frame queued in :attr:`_unsent` (see the module
        docstring). Anything unusual (an error, a reply that cannot leave from here) is
        handed to the loop."""
        frames, quick, unsent, book, conn = self._frames, self._quick, self._unsent, self._book, self._conn
        while frames:
            frame = frames[0]
            if frame is _FOR_LOOP or self.recalled or self._writer.must_drain:
                self.let_go()
                return
            header = frame.header
            fn, value = self._admit(header, frame.data)
            if fn is None:
                self.let_go(value)
                return
            frames.popleft()
            started = monotonic()
            book.thread_running = 1
            try:
                # (No argument lies in a shared segment here: the thread takes no shm or staged
                # call, so no reply by reference into one depends on the arguments being gone.)
                result = self._invoke(fn, value[0], value[1], header, conn)
                del value  # the arguments die with the call, not at the next one
                if result.pending is not None:
                    result = result.settle()
            except BaseException as exc:  # noqa: BLE001 - the call's error reply
                value = None
                book.thread_running = 0
                self._answer_on_loop(frame, started, False, exc)
            else:
                book.thread_running = 0
                # A borrow not yet known to its owner goes out before the reply: the loop's.
                data = reply_frame(frame.call_id, result, conn) \
                    if result.lent is None and not (BORROWS.events or BORROWS.sending) else None
                if data is None:
                    self._answer_on_loop(frame, started, True, result)
                else:
                    # Ended (counted, on the timeline) before it is sent: a caller that reads
                    # the counters or the timeline after its reply finds this call in them.
                    elapsed = self._end_call(header, frame.call_id, started, result.nbytes)
                    method = header.method
                    if method in quick or len(quick) < _MAX_METHODS:
                        quick[method] = elapsed < _QUICK_S
                    unsent.append((data, frame, started, result, elapsed))
                    # The replies wait for the next call only when it is held here and quick.
                    if not frames or len(unsent) >= _MAX_UNSENT or frames[0] is _FOR_LOOP \
                            or not quick.get(frames[0].header.method, False):
                        self._send_unsent()
            if frames:  # what arrived while the last call ran: a CANCEL of a call held here
                self._read()
        self._send_unsent()  # (replies that waited for a call a CANCEL then dropped)
        if self._eof:
            self.let_go()

    def _answer_on_loop(self, frame: worker_pb2.CallFrame, started: float, ok: bool, result: Any) -> None:
        """The loop answers a call run here (an error, a reply that cannot go from here),
        after the replies of the calls before it."""
        self._send_unsent()
        lent = result.lent if ok else None
        if not self._report(frame.call_id, frame.header, started, ok, result):
            return  # the loop is closed: nothing will send the lent reply
        del result
        if lent is not None:  # the reply is sent from the method's memory: nothing may change it
            lent.wait()

    def _send_unsent(self) -> None:
        """Send the replies waiting in :attr:`_unsent` (in one send); when they cannot go
        from this thread, the loop answers those calls instead (uncounted here again)."""
        unsent = self._unsent
        if not unsent:
            return
        data = unsent[0][0] if len(unsent) == 1 else b"".join([u[0] for u in unsent])
        if self._write_frames(data):
            unsent.clear()
            return
        taken = list(unsent)
        unsent.clear()
        for _, frame, started, result, elapsed in taken:
            header = frame.header
            self._unsent_on_thread(header, elapsed, result.nbytes)
            self._report(frame.call_id, header, started, True, result, RING.on)

    def _report(self, call_id: int, header: worker_pb2.CallHeader, started: float, ok: bool, result: Any,
                recorded: bool = False) -> bool:
        """Have the loop answer the call (False: the loop is closed); ``recorded``: its span is
        on the timeline already."""
        try:
            self._loop.call_soon_threadsafe(self.stream.direct_done, call_id, header, started, ok, result,
                                            recorded)
        except RuntimeError:
            return False
        return True
