"""The scheduler with mutual TLS: gRPC and HTTPS need a certificate signed by the cluster CA."""

import json

import aiohttp
import pytest

from podium import errors
from podium.scheduler.client import SchedulerClient
from podium.scheduler.server import run_scheduler
from tests.support.scheduler_fakes import config, node_info


def test_grpc_and_https_with_mutual_tls(token, arun, tls):
    async def scenario():
        running = await run_scheduler(config(token, tls=tls))
        try:
            async with SchedulerClient(running.address, token, tls) as client:
                await client.register_node(node_info("n1", "127.0.0.2", 7001))
                assert len((await client.cluster_state()).nodes) == 1
            async with SchedulerClient(running.address, token, timeout=3) as plain:
                with pytest.raises(errors.UnavailableError):
                    await plain.cluster_state()
            assert running.http_url.startswith("https://")
            connector = aiohttp.TCPConnector(ssl=tls.ssl_context(server=False))
            async with aiohttp.ClientSession(connector=connector) as http:
                async with http.get(running.http_url + "/v1/nodes",
                                    headers={"Authorization": f"Bearer {token}"}) as resp:
                    assert resp.status == 200
                    assert json.loads(await resp.text())["nodes"][0]["info"]["node_id"] == "n1"
        finally:
            await running.stop(0)
    arun(scenario())
