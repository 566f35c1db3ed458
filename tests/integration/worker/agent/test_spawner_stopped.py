"""A SIGSTOPped worker is stopped at once: SIGTERM cannot reach a stopped process before a
SIGCONT (which would let it run again), so the agent sends SIGKILL without waiting out the
grace. This is the fence of a stopped rank that a WorkerGroup replaces (issue 51). Real
worker processes, the exec path; the grace here is an hour."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from podium.process import kernel_state
from podium.v1 import common_pb2
from podium.worker.agent.spawner import Spawner
from tests.support.agentkit import FAKE_WORKER, eventually, run, worker
from tests.support.proctable import alive

pytestmark = pytest.mark.timeout(300)


def test_a_stopped_worker_is_killed_without_the_grace(tmp_path):
    reports = []

    async def body():
        spawner = Spawner(log_dir=tmp_path / "logs", node_id="n", node_address="127.0.0.1",
                          scheduler="127.0.0.1:1", token="t", report=reports.append,
                          command=[sys.executable, str(FAKE_WORKER)], stop_grace=3600.0,
                          base_env={"PATH": os.environ.get("PATH", "")})
        try:
            await spawner.spawn([worker("w0"), worker("w1")])
            await eventually(lambda: {r.worker_id for r in reports if r.state == common_pb2.WORKER_RUNNING}
                             >= {"w0", "w1"}, "both running")
            stopped = spawner.get("w0").pid
            os.kill(stopped, signal.SIGSTOP)
            await eventually(lambda: kernel_state(stopped)[0] == "T", "the worker stopped")  # signals land later
            # A bound, far under the grace: waiting the grace out fails here, not at the timeout.
            assert await asyncio.wait_for(spawner.stop(["w0"]), timeout=120) == 1
            assert not alive(stopped)
            [ended] = [r for r in reports if r.worker_id == "w0" and r.state == common_pb2.WORKER_EXITED]
            assert ended.exit.signal == signal.SIGKILL and ended.exit.requested
            assert spawner.get("w1").alive  # a running worker still gets SIGTERM and its grace
        finally:
            for w in spawner.workers():
                if w.alive:
                    os.kill(w.pid, signal.SIGKILL)
            await spawner.stop_all()
    run(body())
