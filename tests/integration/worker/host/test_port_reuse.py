"""A new worker on the port of one that just exited is reachable at once.

Worker ports are reused by the kernel. gRPC shares connections between channels to the
same address, so a connection still backing off from the dead worker used to fail the new
worker's first call with "Connection refused" (seen in a full run).
"""

from __future__ import annotations

from podium import errors
from podium.worker.caller.client import WorkerClient
from podium.worker.host.process import start_host


def test_a_reused_port_reaches_the_new_worker(token, arun):
    async def scenario():
        first = await start_host("127.0.0.1", token=token, env={"PODIUM_WORKER_ID": "old-worker"})
        port = first.port
        old = WorkerClient(f"127.0.0.1:{port}", token)
        assert (await old.describe(timeout=10)).worker_id == "old-worker"
        await first.stop()
        # The old channel notices the peer is gone and starts backing off.
        for _ in range(3):
            try:
                await old.describe(timeout=1)
            except (errors.UnavailableError, errors.DeadlineExceededError):
                pass
            else:
                raise AssertionError("the stopped worker still answered")
        second = await start_host("127.0.0.1", token=token, port=port,
                                  env={"PODIUM_WORKER_ID": "new-worker"})
        try:
            assert second.port == port
            new = WorkerClient(f"127.0.0.1:{port}", token)
            info = await new.describe(timeout=10)
            assert info.worker_id == "new-worker"  # the new worker, not a stale connection
            await new.close()
        finally:
            await old.close()
            await second.stop()

    arun(scenario(), timeout=60)
