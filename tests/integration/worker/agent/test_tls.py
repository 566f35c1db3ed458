"""The node agent with mutual TLS, against the real in-process scheduler (also on TLS)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from podium import errors, rpc
from podium.scheduler.client import SchedulerClient
from podium.scheduler.server import run_scheduler
from podium.scheduler.service import SchedulerConfig
from podium.v1 import node_pb2, node_pb2_grpc
from podium.worker.agent.service import AgentConfig, run_agent


def test_agent_registers_and_serves_over_mutual_tls(tmp_path, token, arun, tls):
    async def scenario():
        scheduler = await run_scheduler(SchedulerConfig(token=token, port=0, http_port=0, tls=tls,
                                                        heartbeat_interval=0.2))
        agent = await run_agent(AgentConfig(scheduler=scheduler.address, node_id="tls-node", fake_gpus=1,
                                            log_dir=str(tmp_path / "logs"), token=token, tls=tls))
        try:
            await asyncio.wait_for(agent.registered.wait(), 20)
            async with SchedulerClient(scheduler.address, token, tls) as client:
                deadline = time.monotonic() + 20
                while not (await client.cluster_state()).nodes:
                    assert time.monotonic() < deadline, "node never showed up"
                    await asyncio.sleep(0.05)
                node = (await client.cluster_state()).nodes[0]
                assert (node.info.node_id, node.info.agent_port) == ("tls-node", agent.port)

            secure = rpc.make_channel(agent.address, token, tls)
            try:
                info = await node_pb2_grpc.NodeAgentStub(secure).GetNodeInfo(
                    node_pb2.GetNodeInfoRequest(), timeout=10)
                assert info.node_id == "tls-node" and len(info.gpus) == 1
            finally:
                await secure.close()

            plain = rpc.make_channel(agent.address, token)
            try:
                with pytest.raises(grpc.RpcError) as caught:
                    await node_pb2_grpc.NodeAgentStub(plain).GetNodeInfo(
                        node_pb2.GetNodeInfoRequest(), timeout=3)
                assert isinstance(rpc.error_from_rpc(caught.value), errors.UnavailableError)
            finally:
                await plain.close()
        finally:
            await agent.stop()
            await scheduler.stop(0)

    arun(scenario(), timeout=90)
