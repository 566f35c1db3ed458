"""Issue #34 on a node agent's metrics port: the scheduler's HTTP bounds hold there too.
Silent connections re-opened as fast as they are closed fail no /healthz probe and no
token /metrics scrape, and an endless chunked body is cut off with 413, not read."""

from __future__ import annotations

import asyncio
import socket

import pytest

from podium import httplimits
from podium.worker.agent.service import AgentConfig, run_agent
from tests.support.agentkit import TOKEN, run
from tests.support.httpattack import SilentFlood, endless_chunked_post, probe

pytestmark = pytest.mark.faults

PROBES = 30


def _free_port() -> int:
    with socket.socket() as sock:  # nobody serves it: the agent keeps retrying the scheduler
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_metrics_port_answers_probes_under_a_silent_flood_and_refuses_bodies(tmp_path):
    async def body():
        config = AgentConfig(scheduler=f"127.0.0.1:{_free_port()}", node_id="node-m", fake_gpus=1,
                             log_dir=str(tmp_path / "logs"), token=TOKEN, metrics_port=0)
        agent = await run_agent(config)
        try:
            port = agent.metrics.port
            async with SilentFlood("127.0.0.1", port, 2 * httplimits.HTTP_MAX_CONNECTIONS) as flood:
                while flood.closed_by_server < flood.lanes:
                    await asyncio.sleep(0.05)
                answers = []
                for _ in range(PROBES):
                    answers.append(await probe("127.0.0.1", port, "/healthz"))
                    await asyncio.sleep(0.05)
                # (A scrape asks every worker; on a loaded machine it may take longer than a probe.)
                scrape = await probe("127.0.0.1", port, "/metrics", token=TOKEN, timeout=20.0)
            print(f"\n{flood.opened} silent connections opened; probes {answers}; scrape {scrape}")
            assert answers == [200] * PROBES
            assert scrape == 200
            for path in ("/healthz", "/metrics"):
                status, sent = await asyncio.to_thread(endless_chunked_post, "127.0.0.1", port,
                                                       path, 256 << 20)
                assert status.startswith(b"HTTP/1.1 413"), status
                assert sent < 16 << 20
            assert await probe("127.0.0.1", port, "/healthz") == 200
        finally:
            await agent.stop()

    run(body())
