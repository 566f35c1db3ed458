"""The scheduler's side of its node agents: one channel per node, and stopping workers on them.

Calls to agents happen after a mutation is committed (the model never waits on the
network); a stop that fails is retried by the node's next heartbeat, whose answer lists
the workers the scheduler does not want.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc

from podium import errors
from podium.auth import TlsConfig
from podium.rpc import error_from_rpc, make_channel
from podium.scheduler.records import Effects
from podium.scheduler.state import ClusterModel
from podium.v1 import common_pb2, node_pb2, node_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["AgentLinks", "AGENT_TIMEOUT"]

#: Deadline for one call to a node agent.
AGENT_TIMEOUT = 30.0


class AgentLinks:
    """Channels to the node agents of ``model``'s nodes (made on first use, remade when a node
    moves to another address) and the background tasks that stop workers on them."""

    def __init__(self, model: ClusterModel, token: str, tls: TlsConfig | None = None,
                 on_stopped: Callable[[list[str]], Awaitable[None]] | None = None) -> None:
        self.model = model
        self.token = token
        self.tls = tls
        #: Called with the ids an agent answered for: it answers once they are reaped.
        self.on_stopped = on_stopped
        self._agents: dict[str, tuple[str, grpc.aio.Channel, node_pb2_grpc.NodeAgentStub]] = {}
        self._tasks: set[asyncio.Task] = set()

    def stub(self, node_id: str) -> node_pb2_grpc.NodeAgentStub:
        """The NodeAgent stub of a known node (NotFoundError for an unknown one)."""
        info = self.model.node(node_id).info
        target = f"{info.address}:{info.agent_port}"
        cached = self._agents.get(node_id)
        if cached is not None and cached[0] == target:
            return cached[2]
        if cached is not None:
            self._background(cached[1].close())
        channel = make_channel(target, self.token, self.tls)
        stub = node_pb2_grpc.NodeAgentStub(channel)
        self._agents[node_id] = (target, channel, stub)
        return stub

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop_workers(self, effects: Effects, grace: float = 0.0) -> None:
        """Ask each alive node's agent to stop the workers ``effects`` lists for it; a failure
        is logged (the workers stay STOPPING, holding their slots; the heartbeat's stop list
        retries). The ids of each stop that succeeded go to ``on_stopped``: the agent answers
        only once the processes are reaped, so their slots are free at once."""
        async def stop(node_id: str, ids: list[str]) -> None:
            node = self.model.nodes.get(node_id)
            if node is None or node.state != common_pb2.NODE_ALIVE:
                return  # a dead node's workers are gone or will be told by its next heartbeat
            try:
                await self.stub(node_id).StopWorkers(
                    node_pb2.StopWorkersRequest(worker_ids=ids, grace_seconds=grace),
                    timeout=AGENT_TIMEOUT + grace)
            except errors.NotFoundError:
                return  # the agent stopped none: its heartbeat, no longer listing them, ends them
            except grpc.RpcError as exc:
                log.warning("StopWorkers on node %s failed: %s", node_id,
                            error_from_rpc(exc, what=f"node {node_id}"))
                return
            if self.on_stopped is not None:
                await self.on_stopped(ids)
        await asyncio.gather(*(stop(n, ids) for n, ids in effects.stop.items() if ids))

    def stop_later(self, effects: Effects) -> None:
        """:meth:`stop_workers` in a background task (the caller answers without waiting)."""
        if effects.stop:
            self._background(self.stop_workers(effects))

    async def close(self) -> None:
        """Cancel the background stops and close every channel."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for _, channel, _ in self._agents.values():
            await channel.close()
        self._agents.clear()
