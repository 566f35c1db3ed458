"""Issue #14, item 8: idle and slow HTTP clients are timed out and open connections are
capped, so they cannot use up the scheduler's file descriptors."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from podium import httplimits
from tests.support.scheduler_fakes import Cluster

pytestmark = pytest.mark.faults

CAP = 16


async def _closed(reader: asyncio.StreamReader, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection (TimeoutError if it does not)."""
    return await asyncio.wait_for(reader.read(), deadline)


def test_idle_connections_time_out_and_the_oldest_silent_ones_make_room(token, arun, monkeypatch):
    monkeypatch.setattr(httplimits, "HTTP_IDLE_SECONDS", 0.5)
    monkeypatch.setattr(httplimits, "HTTP_FIRST_REQUEST_SECONDS", 0.5)
    monkeypatch.setattr(httplimits, "HTTP_MAX_CONNECTIONS", CAP)

    async def scenario():
        async with Cluster(token, agents=0) as c:
            port = c.running.http_port
            server = c.running.http._runner.server
            # A slow client: half a request, then silence.
            slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", port)
            slow_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            await slow_writer.drain()
            conns = []
            for _ in range(3 * CAP):
                conns.append(await asyncio.open_connection("127.0.0.1", port))
                assert len(server.connections) <= CAP  # the descriptor bound of #14 holds
            answers = await asyncio.gather(*(_closed(r, 30) for r, _ in conns))
            evicted = [i for i, a in enumerate(answers) if a.startswith(b"HTTP/1.1 503")]
            print(f"\n{len(conns)} silent connections: {len(evicted)} closed to make room (cap {CAP}), "
                  f"the rest at their first-request deadline")
            # The oldest silent ones made room, never the newcomer; none was refused.
            assert len(evicted) >= 2 * CAP - 1 and evicted == list(range(len(evicted)))
            assert server.evicted >= len(evicted) and server.refused == 0
            assert await _closed(slow_reader, 30) == b""
            for _, writer in conns:
                writer.close()
            slow_writer.close()
            # Still serving HTTP and gRPC.
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/healthz") as reply:
                    assert reply.status == 200
            assert (await c.client.cluster_state()).scheduler_id
    arun(scenario(), timeout=120)
