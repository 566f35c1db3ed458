"""The one way out of a call in the worker host: counted, put on the timeline, answered.

A call comes in one way (:mod:`podium.worker.host.admission`) and ends in one of four
places, each of which calls a :class:`CallCompletion`:

- the loop's fast path, whose reply the execution thread sends itself
  (:meth:`CallCompletion.send_from_thread`) or the loop writes (:meth:`CallCompletion.end_fast`);
- the execution thread reading the socket itself (:mod:`podium.worker.host.directcalls`),
  answering from the thread (:meth:`CallCompletion.end_on_thread`) or handing the reply to
  the loop (``CallStream.direct_done``, then :meth:`CallCompletion.end_fast`);
- the loop's general path (:meth:`CallCompletion.send` answers, :meth:`CallCompletion.end_general`
  counts).

There is one book of counters: the per-method rows (:class:`~podium.worker.host.methodstats.MethodTable`),
one writer per thread so that no count is lost without a lock per call. Every ending records
exactly one row, under its method, :data:`~podium.worker.host.methodstats.CONSTRUCT`, or
:data:`~podium.worker.host.methodstats.UNRESOLVED` (a call that found no method; no row in
Describe's ``method_stats``). The per-worker counters (calls, seconds, bytes) are those rows
added up (:meth:`CallBook.stats_now`); the loop alone writes the rest (errors, calls in
flight, which writer answered).

The writer is picked here too: the thread's send of a small reply, the loop's write of
one frame, a bulk frame, or chunks (the stream's own writers, :class:`ReplyWriter`).
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from time import monotonic
from collections.abc import Callable
from typing import Any, Protocol

from podium import errors
from podium.borrows import BORROWS
from podium.tracering import RING, mono_to_ns, now_ns
from podium.transport import chunks
from podium.transport.connection import CallConnection
from podium.transport.frames import CONSTRUCT as CONSTRUCT_KIND, FRAME_LENGTH, frame_with_call_id
from podium.v1 import worker_pb2
from podium.worker.host.activecall import ActiveCall
from podium.worker.host.methodstats import BUCKET_BOUNDS, CONSTRUCT, ROW_IN, ROW_OUT, ROW_SUM, UNRESOLVED, MethodTable
from podium.worker.host.results import NONE_OUTCOME, NONE_REPLY_TAIL, Outcome

__all__ = ["CallBook", "CallCompletion", "ReplyWriter", "reply_frame"]

log = logging.getLogger("podium.worker.host")

_LEN = FRAME_LENGTH


def reply_frame(call_id: int, outcome: Any, conn: CallConnection) -> bytes | None:
    """The length-prefixed reply frame of a small ``outcome`` that carries its bytes or of a
    held result's ref (a ``blocking=False`` call's), as the execution thread sends it; None
    when it cannot go from there (a shared-memory or bulk reply: the loop sends those)."""
    if outcome is NONE_OUTCOME:  # most replies: checked first
        tail = NONE_REPLY_TAIL
    elif type(outcome) is not Outcome or outcome.shm_name or (outcome.ref is None and conn.takes_bulk(outcome.nbytes)):
        return None
    else:
        tail = outcome.reply_tail()
    message = frame_with_call_id(call_id, tail)
    return _LEN.pack(len(message)) + message


class CallBook:
    """A host's one book of call counters: the method rows, and the loop's own counters in
    ``stats`` (see the module docstring)."""

    def __init__(self, stats: dict, methods: MethodTable) -> None:
        #: The loop's counters (and the host's others): calls in flight, errors, writers.
        self.stats = stats
        #: The rows every ending records one of.
        self.methods = methods
        #: 1 while the execution thread runs a call it read itself (only it writes).
        self.thread_running = 0

    def stats_now(self) -> dict:
        """``stats`` with the rows added up: ``calls`` (the calls that found their method),
        ``call_seconds`` (every call and the constructor), ``bytes_in``, ``bytes_out``; and
        the calls the execution thread read and answered itself in ``direct_calls`` and
        ``thread_replies``."""
        totals = [0, 0.0, 0, 0]
        thread_calls = 0
        for counts in (self.methods.loop, self.methods.thread):
            for name, row in list(counts.rows.items()):  # (the other thread may add a row)
                count = sum(row[:ROW_SUM])
                if name != CONSTRUCT and name != UNRESOLVED:
                    totals[0] += count
                    if counts is self.methods.thread:
                        thread_calls += count
                totals[1] += row[ROW_SUM]
                totals[2] += row[ROW_IN]
                totals[3] += row[ROW_OUT]
        stats = dict(self.stats)
        stats["calls"], stats["call_seconds"], stats["bytes_in"], stats["bytes_out"] = totals
        stats["direct_calls"] += thread_calls
        stats["thread_replies"] += thread_calls
        stats["calls_in_flight"] += self.thread_running
        return stats


class ReplyWriter(Protocol):
    """The writers of the stream a call came on (a ``CallStream``), and its calls."""

    active: dict
    fast_finished: Any

    @property
    def conn(self) -> CallConnection:
        """The stream's call connection."""

    def error_frame(self, call_id: int, exc: BaseException) -> worker_pb2.ReplyFrame:
        """The reply frame that answers ``call_id`` with ``exc``."""

    def reply_nowait(self, call_id: int, outcome: Outcome) -> bool:
        """Queue a one-frame or bulk reply on the raw socket; False when it must stream in chunks."""

    def reply_later(self, active: ActiveCall, outcome: Outcome) -> None:
        """Send ``outcome`` in chunks, as ``active``'s task."""

    def single_frame(self, call_id: int, outcome: Outcome) -> worker_pb2.ReplyFrame | None:
        """The one reply frame of ``outcome``, or None when it streams in chunks."""

    async def write(self, frame: worker_pb2.ReplyFrame) -> None:
        """Send one reply frame, in order with the others."""


class CallCompletion:
    """Ends the calls of one stream: counts each in the host's :class:`CallBook`, puts its
    span on the timeline, and picks the writer of its reply (see the module docstring)."""

    def __init__(self, book: CallBook, writer: ReplyWriter, resolved: Callable[[str], bool]) -> None:
        self.book = book
        self._stats = book.stats
        self._loop_rows = book.methods.loop
        # The execution thread's rows, written in end_on_thread (inline: the hot path at scale).
        self._thread_counts = book.methods.thread
        self._thread_rows = book.methods.thread.rows
        self._writer = writer
        self._conn = writer.conn
        self._resolved = resolved  # whether a method name was found (it gets a row of its own)

    # ------------------------------------------------------------ the execution thread

    def end_on_thread(self, header: worker_pb2.CallHeader, call_id: int, started: float, nbytes: int) -> float:
        """A call the execution thread read and ran, whose reply it sends itself: counted in
        its row and put on the timeline before the reply leaves (a caller that reads the
        counters or the timeline next finds it). Returns the call's seconds."""
        elapsed = monotonic() - started
        method = header.method
        row = self._thread_rows.get(method)
        if row is None:
            row = self._thread_counts.row(method)
        row[bisect_left(BUCKET_BOUNDS, elapsed)] += 1
        row[ROW_SUM] += elapsed
        row[ROW_IN] += header.payload_size
        row[ROW_OUT] += nbytes
        if RING.on:
            RING.add("call", method, mono_to_ns(started), now_ns(), header.trace_id, call_id,
                     header.payload_size, nbytes)
        return elapsed

    def unsent_on_thread(self, header: worker_pb2.CallHeader, elapsed: float, nbytes: int) -> None:
        """Take back a call :meth:`end_on_thread` counted whose reply could not leave from
        the thread: the loop answers and counts it instead."""
        self._thread_counts.record(header.method, elapsed, header.payload_size, nbytes, -1)

    def send_from_thread(self, active: ActiveCall, ok: bool, result: Any) -> bool:
        """The thread's send: a fast-path call's small reply, from the execution thread
        (True if it went; one wake-up of the loop fewer per call). :meth:`end_fast` counts it
        later, on the loop."""
        if not ok or BORROWS.events or BORROWS.sending:  # (borrows go out first: :meth:`send`)
            return False
        if RING.on:  # before the reply leaves: a caller that reads the timeline next finds it
            header = active.header
            RING.add("call", header.method, mono_to_ns(active.started), now_ns(), header.trace_id, active.call_id,
                     header.payload_size, getattr(result, "nbytes", 0))
            active.recorded = True
        # (A lent reply is a bulk one: reply_frame leaves it to the loop.)
        data = reply_frame(active.call_id, result, self._conn)
        if data is None or not self._conn.carrier.loan.write_frames_from_thread(data):
            return False
        active.answered = monotonic()
        return True

    # ------------------------------------------------------------ the loop

    def begin(self) -> None:
        """A call starts (on the loop): it is in flight until its ending."""
        self._stats["calls_in_flight"] += 1

    def end_fast(self, active: ActiveCall, ok: bool, result: Any) -> None:
        """A call the execution thread ran without a task (the fast path, or one it read
        itself; on the loop): counted, on the timeline, and answered unless the thread did."""
        stats = self._stats
        stats["calls_in_flight"] -= 1
        ended = active.answered or monotonic()
        header = active.header
        nbytes = result.nbytes if ok and type(result) is Outcome else 0
        # (A call cancelled unread may name no method.)
        row = header.method if ok or self._resolved(header.method) else UNRESOLVED
        self._loop_rows.record(row, ended - active.started, header.payload_size, nbytes)
        call_id = active.call_id
        if RING.on and not active.recorded:
            RING.add("call", header.method, mono_to_ns(active.started), mono_to_ns(ended), header.trace_id, call_id,
                     header.payload_size, nbytes, ok)
        writer = self._writer
        writer.active.pop(call_id, None)  # (before a reply in chunks makes it a task of its own)
        try:
            if active.answered:  # the thread's send
                stats["thread_replies"] += 1
            elif not ok:
                stats["call_errors"] += 1
                self._conn.write_nowait(writer.error_frame(call_id, result))
            # The loop's write or bulk; else chunks, or borrows to settle first (awaited).
            elif BORROWS.events or BORROWS.sending or not writer.reply_nowait(call_id, result):
                writer.reply_later(active, result)
        except errors.PodiumError:
            pass  # the connection is closed: nobody to tell
        finished = writer.fast_finished
        if finished is not None and not finished.done():
            finished.set_result(None)

    async def send(self, call_id: int, outcome: Outcome) -> None:
        """The general path's reply (awaited): the loop's write or a bulk frame on the raw
        socket, else one frame or chunks on the stream. The borrows the call made or gave
        back reach their owners first (podium.borrows)."""
        if BORROWS.events or BORROWS.sending:
            await BORROWS.settle()
        conn, writer = self._conn, self._writer
        if conn.writes_nowait and writer.reply_nowait(call_id, outcome):
            if conn.must_drain:
                await conn.carrier.drain()
            return
        try:  # a lent reply (only ever a bulk frame, above) is let go whatever happens here
            frame = writer.single_frame(call_id, outcome)
            if frame is not None:
                await writer.write(frame)
                return
            header = outcome.header()
            await conn.send_chunks(call_id, header, (bytes(c) for c in chunks.iter_chunks(outcome.segments)))
        finally:
            if outcome.lent is not None:
                outcome.lent.release()

    def end_general(self, active: ActiveCall, started: float, ok: bool, resolved: bool) -> None:
        """A call or constructor of the loop's general path ended (its task answered it,
        with its value or its error)."""
        stats = self._stats
        stats["calls_in_flight"] -= 1
        if not ok:
            stats["call_errors"] += 1
        seconds = monotonic() - started
        header = active.header
        if RING.on:
            RING.add("call", header.method, mono_to_ns(started), now_ns(), header.trace_id, active.call_id,
                     header.payload_size, active.bytes_out, ok)
        row = CONSTRUCT if header.kind == CONSTRUCT_KIND else header.method if resolved else UNRESOLVED
        self._loop_rows.record(row, seconds, header.payload_size, active.bytes_out)
