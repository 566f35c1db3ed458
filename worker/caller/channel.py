"""A worker's gRPC channel and its unary RPCs: Describe, Fetch, Release, Shutdown.

:class:`WorkerChannel` is what a process needs to read a worker's results (the controller's
ref fetches, a worker fetching its arguments from a peer);
:class:`~podium.worker.caller.client.WorkerClient` holds one beside its call connection.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any

import grpc

from podium import codec, errors, rpc
from podium.auth import TlsConfig
from podium.refs import ObjectRef
from podium.transport import chunks, shm
from podium.transport.payload import shares_shm
from podium.transport.shm import DEFAULT_SHM_THRESHOLD_BYTES as _DEFAULT_SHM_THRESHOLD
from podium.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["WorkerChannel", "MAX_REPLY_BYTES", "RELEASE_PER_CALL"]

#: The largest reply a client assembles (a bound against a misbehaving peer).
MAX_REPLY_BYTES = 1 << 40
#: Most held-result ids one call frame carries to release (``releasable``; ~20 bytes each).
RELEASE_PER_CALL = 256

log = logging.getLogger("podium.worker.caller.channel")


class WorkerChannel:
    """The channel to one worker and its unary RPCs (no call connection)."""

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
        #: Payloads that went through shared memory, each way.
        #: Payloads this client sent and received through shared memory and as bulk frames.
        self.stats = {"shm_sent": 0, "shm_received": 0, "bulk_sent": 0, "bulk_received": 0, "in_place_received": 0}
        #: Ids of held results to drop in the worker (:class:`podium.controller.session.releaser.Releaser`
        #: appends from any thread): the next call frame takes them along, else one Release RPC.
        self.releasable: collections.deque[str] = collections.deque()
        #: The cluster token and TLS settings: the call connection authenticates with them too.
        self.token = token
        self.tls = tls
        #: The token as per-call gRPC metadata.
        self.metadata = rpc.token_metadata(token)
        #: The loop the channel was opened on (every RPC must be awaited there).
        self.loop: asyncio.AbstractEventLoop | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None

    def who(self) -> str:
        """The worker as errors name it: its rank (when known) and address."""
        return f"worker rank {self.rank} at {self.address}" if self.rank >= 0 else f"worker at {self.address}"

    def connect(self) -> None:
        """Open the channel (no RPC); enough for describe/fetch/release/shutdown."""
        if self._channel is not None:
            return
        self.loop = asyncio.get_running_loop()
        # The token goes in per-call metadata rather than through a client
        # interceptor: intercepted streams add a queue and a task per message.
        self._channel = rpc.make_channel(self.address, "", self.tls, add_token=False)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    def stub(self) -> worker_pb2_grpc.WorkerStub:
        """The stub of the channel, connecting first (on the running loop)."""
        self.connect()
        stub = self._stub
        if stub is None:  # connect() always makes one
            raise errors.InternalError(f"no channel to {self.who()} after connect()")
        return stub

    def _rpc_error(self, exc: grpc.aio.AioRpcError, what: str) -> errors.PodiumError:
        err = rpc.error_from_rpc(exc, what=f"{what} on {self.who()}")
        if type(err) is errors.UnavailableError:
            err = errors.UnavailableError(f"{what}: cannot reach {self.who()}: {exc.details()}",
                                          rank=self.rank)
        elif type(err) is errors.DeadlineExceededError and not exc.trailing_metadata():
            err = errors.DeadlineExceededError(f"{what} on {self.who()} timed out", rank=self.rank)
        return err

    async def open_call_socket(self, port: int, on_frame: Any, on_lost: Any, timeout: float | None) -> Any:
        """The worker's raw call socket (token hello first, TLS under TLS), its reply frames
        handed to ``on_frame``; None where it cannot be reached (a firewall between nodes: the
        gRPC ``Calls`` stream works too). A refused token raises."""
        from podium.transport import callsocket

        host, tls = self.address.rsplit(":", 1)[0], self.tls
        try:
            return await callsocket.connect(
                host, port, self.token, worker_pb2.ReplyFrame.FromString, on_frame, on_lost, timeout=timeout,
                max_bulk=MAX_REPLY_BYTES, ssl_context=tls.ssl_context(server=False) if tls is not None else None,
                server_hostname=(tls.server_name or host.strip("[]")) if tls is not None else None)
        except errors.AuthenticationError:
            raise
        except (OSError, asyncio.TimeoutError, errors.PodiumError) as exc:
            log.warning("raw call port of %s unusable (%s); using the gRPC stream", self.who(), exc)
            return None

    async def describe(self, timeout: float | None = 30.0) -> worker_pb2.DescribeResponse:
        """The worker's identity, state and method table."""
        stub = self.stub()
        try:
            return await stub.Describe(worker_pb2.DescribeRequest(), timeout=timeout,
                                             metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc, "Describe") from None

    async def timeline(self, max_events: int = 0, *, timeout: float | None = 10.0
                       ) -> tuple[worker_pb2.TimelineResponse, int, int]:
        """The worker's recent spans (``Timeline``), with this process's wall clock just before
        and just after the call (ns): the caller aligns the two clocks with them."""
        stub = self.stub()
        sent = time.time_ns()
        try:
            reply = await stub.Timeline(worker_pb2.TimelineRequest(max_events=max_events), timeout=timeout,
                                        metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc, "Timeline") from None
        return reply, sent, time.time_ns()

    async def fetch(self, ref: ObjectRef, rows: tuple[int, int] | None = None, *,
                    timeout: float | None = None) -> Any:
        """The value ``ref`` names (or only rows ``[rows[0], rows[1])`` of it), from its owner."""
        stub = self.stub()
        if self.same_host is None and ref.size_bytes >= self.shm_threshold:
            self.same_host = shares_shm(await self.describe(timeout=timeout or 30.0))
        request = worker_pb2.FetchRequest(object_id=ref.object_id,
                                          reply_in_shm=bool(self.same_host) and ref.size_bytes >= self.shm_threshold)
        if rows is not None:
            request.has_rows = True
            request.row_start, request.row_stop = int(rows[0]), int(rows[1])
        assembler = None
        try:
            async for chunk in stub.Fetch(request, timeout=timeout, metadata=self.metadata):
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
            raise errors.DataLossError(f"Fetch of {ref.object_id} from {self.who()} returned nothing")
        self.last_fetch_bytes = assembler.total_size
        return codec.decode(assembler.result())

    async def release(self, object_ids, *, borrow=(), unborrow=(), borrower: str = "",
                      timeout: float | None = 30.0) -> int:
        """Drop held results in the worker (count ``borrow``s and give back ``unborrow``s of
        ids by ``borrower`` first, podium.borrows); returns how many were held."""
        stub = self.stub()
        ids = [r.object_id if isinstance(r, ObjectRef) else r for r in object_ids]
        try:
            reply = await stub.Release(worker_pb2.ReleaseRequest(object_ids=ids, borrow=borrow, unborrow=unborrow,
                                                                 borrower=borrower),
                                             timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc, "Release") from None
        return reply.released

    async def shutdown(self, reason: str = "", *, timeout: float | None = 10.0) -> None:
        """Ask the worker process to exit (it answers first)."""
        stub = self.stub()
        try:
            await stub.Shutdown(worker_pb2.ShutdownRequest(reason=reason), timeout=timeout,
                                      metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc, "Shutdown") from None

    async def close(self) -> None:
        """Close the gRPC channel (a later RPC opens a new one)."""
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()
