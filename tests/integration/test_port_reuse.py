"""A new worker on the port of one that just exited is reachable at once.

Worker ports are reused by the kernel. gRPC shares connections between channels to the
same address, so a connection still backing off from the dead worker used to fail the new
worker's first call with "Connection refused" (seen in a full run).
"""

from __future__ import annotations

import asyncio

from podium.worker.client import WorkerClient
from podium.worker.host.process import start_host


def test_a_reused_port_reaches_the_new_worker(token, arun):
    async def scenario():
        first = await start_host("127.0.0.1", token=token)
        port = first.port
        old = WorkerClient(f"127.0.0.1:{port}", token)
        await old.describe(timeout=10)
        await first.stop()
        # The old channel notices the peer is gone and starts backing off.
        for _ in range(3):
            try:
                await old.describe(timeout=1)
            except Exception:
                pass
        second = await start_host("127.0.0.1", token=token, port=port)
        try:
            new = WorkerClient(f"127.0.0.1:{port}", token)
            info = await new.describe(timeout=10)
            assert info.pid > 0
            await new.close()
        finally:
            await old.close()
            await second.stop()

    arun(scenario(), timeout=60)
