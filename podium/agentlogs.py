"""Reading a worker's output through its node agent (``NodeAgent.TailLog``).

Used by ``podium logs`` and by the controller's log-to-driver streams. The
scheduler knows where each worker runs (``WorkerInfo.node_id``) and where each
node agent listens (``NodeInfo.address`` + ``agent_port``); the lines
themselves come straight from the agent, never through the scheduler.
"""

from __future__ import annotations

from typing import AsyncIterator

import grpc

from podium.auth import TlsConfig
from podium.errors import NotFoundError
from podium.rpc import error_from_rpc, make_channel
from podium.v1 import common_pb2, node_pb2, node_pb2_grpc, scheduler_pb2

__all__ = ["agent_address", "find_worker", "tail_log"]


def agent_address(state: scheduler_pb2.ClusterState, node_id: str) -> str:
    """``host:port`` of the node agent of ``node_id`` (NotFoundError if unknown)."""
    for node in state.nodes:
        if node.info.node_id == node_id:
            return f"{node.info.address}:{node.info.agent_port}"
    raise NotFoundError(f"node {node_id!r} is not registered with the scheduler")


def find_worker(state: scheduler_pb2.ClusterState, key: str) -> common_pb2.WorkerInfo:
    """The worker whose id or name is ``key``; a live one wins over ended ones of that name."""
    matches = [w for w in state.workers if key in (w.id, w.spec.name)]
    if not matches:
        known = ", ".join(sorted(w.spec.name or w.id for w in state.workers)[:20]) or "none"
        raise NotFoundError(f"no worker with id or name {key!r} (known: {known})")
    live = (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING)
    matches.sort(key=lambda w: (w.state not in live, w.id != key))
    return matches[0]


async def tail_log(address: str, token: str, worker_id: str, *, last_lines: int = 0,
                   follow: bool = False, tls: TlsConfig | None = None,
                   timeout: float | None = None) -> AsyncIterator[node_pb2.LogLine]:
    """Yield the worker's log lines from its agent at ``address`` (stdout's, then stderr's;
    with ``follow``, new lines of both as they come, until the worker exits).

    ``last_lines`` 0 starts at the top of each file. Errors are podium errors.
    """
    channel = make_channel(address, token, tls)
    try:
        stub = node_pb2_grpc.NodeAgentStub(channel)
        call = stub.TailLog(node_pb2.TailLogRequest(worker_id=worker_id, last_lines=last_lines,
                                                    follow=follow), timeout=timeout)
        try:
            async for line in call:
                yield line
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, what=f"node agent {address} TailLog") from None
        finally:
            call.cancel()
    finally:
        await channel.close()
