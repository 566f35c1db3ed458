"""The ``podium.v1.Worker`` gRPC service: a thin shell over the host runtime.

Each RPC hands its request to :class:`~podium.worker.host.runtime.HostRuntime` and turns
errors into statuses (:func:`podium.rpc.handle_errors`); the ``Calls`` stream is served by a
:class:`~podium.worker.host.callstream.CallStream`, as the raw call socket's connections are.
"""

from __future__ import annotations

import os

from podium import errors, rpc
from podium.limits import MAX_REPEATED, check_count
from podium.tracering import RING, now_ns
from podium.v1 import worker_pb2, worker_pb2_grpc
from podium.worker.host.callstream import CallStream
from podium.worker.host.runtime import HostRuntime
from podium.worker.host.threadstacks import thread_stacks

__all__ = ["WorkerServicer"]

#: The longest borrower address a Release may name ("host:port", or "[v6]:port").
_MAX_BORROWER_CHARS = 512


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """The ``podium.v1.Worker`` service around one :class:`HostRuntime`."""

    def __init__(self, runtime: HostRuntime) -> None:
        self.runtime = runtime

    async def Calls(self, request_iterator, context):
        """The call stream: CallFrames in, ReplyFrames out (interleaved by call_id)."""
        await CallStream(self.runtime, context).run()

    @rpc.handle_errors
    async def Describe(self, request, context):
        """Identity, state and method table of the hosted object."""
        return self.runtime.describe()

    @rpc.handle_errors
    async def Fetch(self, request, context):
        """Stream a held result (or a row range of it) in chunks or through shared memory."""
        async for chunk in self.runtime.fetch_chunks(request):
            yield chunk

    @rpc.handle_errors
    async def Release(self, request, context):
        """Count borrows and give them back, then drop held results (see HeldStore)."""
        held = self.runtime.held
        for ids, what in ((request.borrow, "borrow"), (request.unborrow, "unborrow")):
            check_count(len(ids), MAX_REPEATED, f"release: {what} ids")
        borrower = request.borrower
        if len(borrower) > _MAX_BORROWER_CHARS:
            raise errors.InvalidArgumentError(
                f"release: a borrower address of {len(borrower)} characters (the most: {_MAX_BORROWER_CHARS})")
        if request.borrow:
            held.borrow(request.borrow, borrower)
            watch = self.runtime.borrower_watch
            if watch is not None:
                watch.ensure()
        held.unborrow(request.unborrow, borrower)
        return worker_pb2.ReleaseResponse(released=held.release(request.object_ids))

    @rpc.handle_errors
    async def Shutdown(self, request, context):
        """Answer, then stop the process shortly after."""
        self.runtime.request_shutdown(request.reason)
        return worker_pb2.ShutdownResponse()

    @rpc.handle_errors
    async def Timeline(self, request, context):
        """This process's recent spans (podium.tracering), oldest first, and its clock."""
        spans = RING.spans(request.max_events)
        events = [worker_pb2.TraceEvent(kind=s.kind, name=s.name, start_ns=s.start_ns, end_ns=s.end_ns,
                                        trace_id=s.trace_id, call_id=s.call_id, bytes_in=s.bytes_in,
                                        bytes_out=s.bytes_out, ok=s.ok) for s in spans]
        return worker_pb2.TimelineResponse(now_ns=now_ns(), events=events, dropped=RING.dropped)

    @rpc.handle_errors
    async def Stacks(self, request, context):
        """Every thread's Python stack, read on this loop (the execution thread may be busy)."""
        config = self.runtime.config
        return worker_pb2.StacksResponse(worker_id=config.worker_id, rank=config.rank, pid=os.getpid(),
                                         threads=thread_stacks(request.max_frames))
