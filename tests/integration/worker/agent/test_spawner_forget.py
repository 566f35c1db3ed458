"""The agent remembers at most MAX_ENDED_WORKERS ended workers (for ListWorkers and TailLog):
the ones that ended first are forgotten, a live one never is, and a restarted id counts
once (real worker processes, the exec path)."""

from __future__ import annotations

import os
import sys

from podium.v1 import common_pb2
from podium.worker.agent import spawner as spawner_module
from podium.worker.agent.spawner import Spawner
from tests.support.agentkit import FAKE_WORKER, eventually, run, worker


def test_the_workers_that_ended_first_are_forgotten_beyond_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(spawner_module, "MAX_ENDED_WORKERS", 3)
    reports = []

    async def body():
        spawner = Spawner(log_dir=tmp_path / "logs", node_id="n", node_address="127.0.0.1",
                          scheduler="127.0.0.1:1", token="t", report=reports.append,
                          command=[sys.executable, str(FAKE_WORKER)],
                          base_env={"PATH": os.environ.get("PATH", "")})

        def running(*ids):
            return {r.worker_id for r in reports if r.state == common_pb2.WORKER_RUNNING} >= set(ids)

        async def start(*ids):
            await spawner.spawn([worker(i) for i in ids])
            await eventually(lambda: running(*ids), f"{ids} running")

        def known():
            return {w.id for w in spawner.workers()}

        try:
            names = [f"w{i}" for i in range(6)]
            await start(*names)
            for name in names:  # they end in this order
                await spawner.stop([name])
            assert known() == {"w3", "w4", "w5"}
            reports.clear()
            await start("w3")  # an ended id started again: live, and no longer counted as ended
            await start("w6")
            await spawner.stop(["w6"])
            assert known() == {"w3", "w4", "w5", "w6"}
            await spawner.stop(["w3"])  # four ended now: w4 ended first
            assert known() == {"w5", "w6", "w3"}
            assert all(not w.alive for w in spawner.workers())
        finally:
            await spawner.stop_all()
    run(body())
