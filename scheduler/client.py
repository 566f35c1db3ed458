"""``SchedulerClient``: the async Python face of the Scheduler service.

Used by node agents, the controller SDK and tests. Methods take plain Python
arguments (or the spec messages where a message is the natural unit:
``NodeInfo``, ``WorkerSpec``) and return the response messages of
``podium.v1`` (``PlacementGroup``, ``WorkerInfo`` lists, ...). Every call has a
deadline; failures raise the :mod:`podium.errors` class the server raised
(``InfeasibleError``, ``SlotFullError``, ``NotFoundError``, ...), transport
failures ``UnavailableError`` naming the scheduler address.
"""

from __future__ import annotations

import asyncio
import numbers
from collections.abc import Iterable, Mapping, Sequence

import grpc

from podium import errors
from podium.auth import TlsConfig
from podium.limits import MAX_GRACE_SECONDS, check_seconds
from podium.resources import Strategy
from podium.rpc import error_from_rpc, make_channel
from podium.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["SchedulerClient", "HeartbeatStream", "DEFAULT_TIMEOUT"]

#: Deadline of a call that does not wait on the server side.
DEFAULT_TIMEOUT = 30.0
# Extra client deadline above a server-side wait, so the server's own
# DEADLINE_EXCEEDED (which says what is pending) arrives first.
_WAIT_MARGIN = 5.0


def _strategy(value: Strategy | int | str) -> common_pb2.Strategy.ValueType:
    # Raw ints go to the server unchecked (it validates); names are parsed here.
    if isinstance(value, int) and not isinstance(value, (bool, Strategy)):
        return common_pb2.Strategy.ValueType(value)
    return common_pb2.Strategy.ValueType(int(Strategy.parse(value)))


def _bundle(resources: Mapping[str, float], index: int) -> common_pb2.Bundle:
    if not isinstance(resources, Mapping):
        raise errors.InvalidSpecError(f"bundle {index}: must be a mapping like {{'CPU': 1, 'GPU': 1}}, "
                                      f"got {resources!r}")
    for key, value in resources.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise errors.InvalidSpecError(f"bundle {index}: {key} must be a number, got {value!r}")
    return common_pb2.Bundle(resources={str(k): float(v) for k, v in resources.items()})


class HeartbeatStream:
    """A node's heartbeats on one long-lived ``HeartbeatStream`` call of ``stub``.

    A beat on an open stream costs the scheduler well under half of a unary ``Heartbeat``
    (see the proto). :meth:`beat` writes one request and reads its answer within
    ``timeout`` seconds, one beat at a time. A beat that fails or runs out of time ends the
    call and raises the podium error (the next beat opens a new call). Against a scheduler
    without the stream (UNIMPLEMENTED) it uses unary ``Heartbeat`` from then on.
    """

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, *, timeout: float, what: str,
                 metadata: Sequence[tuple[str, str]] | None = None) -> None:
        self._stub = stub
        self.timeout = timeout
        self._what = what
        self._metadata = metadata
        self._call: grpc.aio.StreamStreamCall | None = None
        self._unary = False
        self._lock = asyncio.Lock()

    async def beat(self, request: scheduler_pb2.HeartbeatRequest) -> scheduler_pb2.HeartbeatResponse:
        """Send one heartbeat and return the scheduler's answer (raises podium.errors)."""
        async with self._lock:
            if not self._unary:
                try:
                    return await asyncio.wait_for(self._exchange(request), self.timeout)
                except grpc.RpcError as exc:
                    self.close()
                    if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise error_from_rpc(exc, what=f"{self._what} HeartbeatStream") from None
                    self._unary = True  # an older scheduler: unary heartbeats from now on
                except asyncio.TimeoutError:
                    self.close()
                    raise errors.DeadlineExceededError(
                        f"{self._what}: no heartbeat answer within {self.timeout:g} s") from None
                except BaseException:
                    self.close()  # cancelled, or the call was already over: start afresh
                    raise
            try:
                return await self._stub.Heartbeat(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, what=f"{self._what} Heartbeat") from None

    async def _exchange(self, request: scheduler_pb2.HeartbeatRequest) -> scheduler_pb2.HeartbeatResponse:
        call = self._call
        if call is None:
            call = self._call = self._stub.HeartbeatStream(metadata=self._metadata)
        try:
            await call.write(request)
        except asyncio.InvalidStateError:
            pass  # the call is over (the scheduler ended it): reading it raises its status
        response = await call.read()
        if response is grpc.aio.EOF:
            raise errors.UnavailableError(f"{self._what}: the scheduler ended the heartbeat stream")
        return response

    def close(self) -> None:
        """End the open call, if any."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()


class SchedulerClient:
    """Async client of one scheduler at ``address`` ("host:port")."""

    def __init__(self, address: str, token: str, tls: TlsConfig | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT, wait_for_ready: bool = False) -> None:
        self.address = address
        self.timeout = timeout
        # A controller's calls wait (within their deadline) for a scheduler that is down or
        # restarting; a node agent's fail at once, since a refused connection is how its
        # fencing rule knows the scheduler is down (podium.worker.agent.link).
        self._wait_for_ready = wait_for_ready
        self._channel = make_channel(address, token, tls)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._heartbeats = HeartbeatStream(self._stub, timeout=timeout, what=f"scheduler {address}")

    async def close(self) -> None:
        """Close the channel."""
        self._heartbeats.close()
        await self._channel.close()

    async def __aenter__(self) -> "SchedulerClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def call(self, method: str, request, *, timeout: float | None = None,
                   wait_for_ready: bool | None = None):
        """Call any Scheduler RPC by name with a request message (raises podium.errors).
        ``wait_for_ready`` overrides the client's choice for this call."""
        timeout = self.timeout if timeout is None else timeout
        wait = self._wait_for_ready if wait_for_ready is None else wait_for_ready
        try:
            return await getattr(self._stub, method)(request, timeout=timeout, wait_for_ready=wait or None)
        except grpc.RpcError as exc:
            if (wait and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    and self._channel.get_state() != grpc.ChannelConnectivity.READY):
                raise errors.UnavailableError(
                    f"scheduler {self.address} {method}: unreachable for {timeout:g} s (no connection: "
                    "is it running, and is the address right?)", details={"scheduler": self.address}) from None
            raise error_from_rpc(exc, what=f"scheduler {self.address} {method}") from None

    # ---- node agents

    async def register_node(self, node: common_pb2.NodeInfo,
                            running: Iterable[scheduler_pb2.RunningWorker] = ()
                            ) -> scheduler_pb2.RegisterNodeResponse:
        """Register (or re-register) a node; returns the lease and heartbeat interval."""
        return await self.call("RegisterNode", scheduler_pb2.RegisterNodeRequest(
            node=node, running=list(running)))

    async def heartbeat(self, node_id: str, gpus: Iterable[common_pb2.GpuInfo] = (),
                        processes: Iterable[common_pb2.ProcessMemory] = (),
                        running: Iterable[scheduler_pb2.RunningWorker] = ()
                        ) -> scheduler_pb2.HeartbeatResponse:
        """Renew a node lease; the response says reregister / which workers to stop. Sent on
        this client's heartbeat stream (:class:`HeartbeatStream`)."""
        return await self._heartbeats.beat(scheduler_pb2.HeartbeatRequest(
            node_id=node_id, gpus=list(gpus), processes=list(processes), running=list(running)))

    async def report_worker(self, worker_id: str, state: common_pb2.WorkerState.ValueType, *,
                            node_id: str = "", pid: int = 0, port: int = 0,
                            exit: common_pb2.ExitInfo | None = None) -> None:
        """Report a worker state change (WORKER_RUNNING with port, or EXITED/FAILED with exit)."""
        request = scheduler_pb2.ReportWorkerRequest(worker_id=worker_id, state=state,
                                                    node_id=node_id, pid=pid, port=port)
        if exit is not None:
            request.exit.CopyFrom(exit)
        await self.call("ReportWorker", request)

    # ---- sessions

    async def open_session(self, description: str = "", lease_seconds: float = 0.0
                           ) -> scheduler_pb2.OpenSessionResponse:
        """Open a session; returns its id and granted lease."""
        return await self.call("OpenSession", scheduler_pb2.OpenSessionRequest(
            description=description, lease_seconds=lease_seconds))

    async def keep_alive(self, session_id: str) -> bool:
        """Renew a session; False if it had already expired."""
        reply = await self.call("KeepAlive", scheduler_pb2.KeepAliveRequest(session_id=session_id))
        return reply.alive

    async def close_session(self, session_id: str) -> scheduler_pb2.CloseSessionResponse:
        """Close a session and remove what it owns."""
        # Not waiting for a scheduler that is down: a controller exiting then must not hang.
        return await self.call("CloseSession", scheduler_pb2.CloseSessionRequest(session_id=session_id),
                               wait_for_ready=False)

    # ---- placement groups

    async def create_placement_group(self, name: str, bundles: Sequence[Mapping[str, float]],
                                     strategy: Strategy | int | str = Strategy.PACK, *,
                                     detached: bool = False, owner: str = ""
                                     ) -> common_pb2.PlacementGroup:
        """Create a group (CREATED or PENDING); InfeasibleError when it can never fit."""
        request = scheduler_pb2.CreatePlacementGroupRequest(
            name=name, bundles=[_bundle(b, i) for i, b in enumerate(bundles)],
            strategy=_strategy(strategy), detached=detached, owner=owner)
        return await self.call("CreatePlacementGroup", request)

    async def wait_placement_group(self, group_id: str, timeout: float = 60.0
                                   ) -> common_pb2.PlacementGroup:
        """Wait until the group is CREATED (DeadlineExceededError says what is missing)."""
        return await self.call("WaitPlacementGroup", scheduler_pb2.WaitPlacementGroupRequest(
            id=group_id, timeout_seconds=timeout), timeout=timeout + _WAIT_MARGIN)

    async def get_placement_group(self, group_id: str = "", name: str = ""
                                  ) -> common_pb2.PlacementGroup:
        """A group by id or by name."""
        return await self.call("GetPlacementGroup",
                               scheduler_pb2.GetPlacementGroupRequest(id=group_id, name=name))

    async def remove_placement_group(self, group_id: str) -> int:
        """Remove a group; returns how many workers were stopped with it."""
        reply = await self.call("RemovePlacementGroup",
                                scheduler_pb2.RemovePlacementGroupRequest(id=group_id))
        return reply.removed_workers

    # ---- workers

    async def create_workers(self, specs: Sequence[common_pb2.WorkerSpec], *, owner: str = "",
                             master_rank: int = 0, timeout: float = 60.0
                             ) -> list[common_pb2.WorkerInfo]:
        """Reserve slots and spawn workers; returns them STARTING, env filled in.

        SlotFullError at once when a slot is full (nothing reserved then).
        """
        reply = await self.call("CreateWorkers", scheduler_pb2.CreateWorkersRequest(
            specs=list(specs), owner=owner, master_rank=master_rank), timeout=timeout)
        return list(reply.workers)

    async def wait_workers(self, ids: Sequence[str], timeout: float = 60.0
                           ) -> list[common_pb2.WorkerInfo]:
        """Wait until all are RUNNING; WorkerDiedError if one failed or exited."""
        reply = await self.call("WaitWorkers", scheduler_pb2.WaitWorkersRequest(
            ids=list(ids), timeout_seconds=timeout), timeout=timeout + _WAIT_MARGIN)
        return list(reply.workers)

    async def get_workers(self, ids: Sequence[str] = (), names: Sequence[str] = (),
                          group: str = "") -> list[common_pb2.WorkerInfo]:
        """Workers by ids, by names, or every worker of a group in rank order."""
        reply = await self.call("GetWorkers", scheduler_pb2.GetWorkersRequest(
            ids=list(ids), names=list(names), group=group))
        return list(reply.workers)

    async def remove_workers(self, ids: Sequence[str], grace_seconds: float = 0.0) -> int:
        """Stop workers and release their slots; returns how many were still live."""
        grace_seconds = check_seconds(grace_seconds, "grace_seconds", MAX_GRACE_SECONDS)
        reply = await self.call("RemoveWorkers", scheduler_pb2.RemoveWorkersRequest(
            ids=list(ids), grace_seconds=grace_seconds), timeout=self.timeout + grace_seconds)
        return reply.stopped

    async def assign_workers(self, assignments: Sequence[tuple[str, str, int, int]]) -> list[common_pb2.WorkerInfo]:
        """Hand live workers to a group: ``(worker_id, group, rank, world_size)`` each (all or
        none); returns their records as they are now."""
        reply = await self.call("AssignWorkers", scheduler_pb2.AssignWorkersRequest(assignments=[
            scheduler_pb2.WorkerAssignment(worker_id=i, group=g, rank=r, world_size=n)
            for i, g, r, n in assignments]))
        return list(reply.workers)

    async def cluster_state(self) -> scheduler_pb2.ClusterState:
        """Nodes, placement groups and workers."""
        return await self.call("GetClusterState", scheduler_pb2.GetClusterStateRequest())
