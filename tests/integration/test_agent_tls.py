"""The node agent with mutual TLS, against the real in-process scheduler (also on TLS)."""

from __future__ import annotations

import asyncio
import subprocess
import time

import grpc
import pytest

from podium import errors, rpc
from podium.auth import TlsConfig
from podium.scheduler.client import SchedulerClient
from podium.scheduler.server import run_scheduler
from podium.scheduler.service import SchedulerConfig
from podium.v1 import node_pb2, node_pb2_grpc
from podium.worker.agent.service import AgentConfig, run_agent


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def tls(tmp_path) -> TlsConfig:
    """A throwaway CA and one certificate for 127.0.0.1 (server and client use)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=podium-agent-test-ca", cwd=tmp_path)
    _openssl("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1", cwd=tmp_path)
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                      "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.pem", "-days", "1", "-extfile", "ext.cnf", cwd=tmp_path)
    return TlsConfig(cert=str(tmp_path / "node.pem"), key=str(tmp_path / "node.key"),
                     ca=str(tmp_path / "ca.pem"))


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
