"""Prometheus metrics of a running cluster: the node agent's /metrics (its own gauges and
the counters of each worker host on the node) and the scheduler's /metrics.

``podium up`` starts the cluster (agents get ``--metrics-port 0``); a worker is started
through the scheduler and called directly; the scrape must show its calls, errors,
bytes, seconds and in-flight gauge.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from podium import errors

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def _podium(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "podium.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def _scrape(url: str, token: str | None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        return reply.read().decode()


def _value(text: str, metric: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(metric + "{") or line.startswith(metric + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {metric} {labels} in:\n{text}")


def test_agent_and_scheduler_metrics(tmp_path, token, arun):
    from podium.scheduler.client import SchedulerClient
    from podium.v1 import common_pb2
    from podium.worker.caller.client import WorkerClient

    state_dir = tmp_path / "local"
    env = dict(os.environ, PODIUM_TOKEN=token)
    up = _podium("up", "--dir", str(state_dir), "--nodes", "1", "--gpus-per-node", "1",
                 "--port", "0", "--http-port", "0", env=env)
    assert up.returncode == 0, up.stderr
    try:
        cluster = json.loads((state_dir / "cluster.json").read_text())
        node = cluster["nodes"][0]
        assert node["metrics_port"] > 0
        metrics_url = f"http://{node['address']}:{node['metrics_port']}/metrics"
        assert metrics_url in up.stdout
        with pytest.raises(urllib.error.HTTPError) as refused:
            _scrape(metrics_url, None)
        assert refused.value.code == 401
        idle = _scrape(metrics_url, token)
        assert _value(idle, "podium_node_gpus") == 1
        assert _value(idle, "podium_node_workers", state="RUNNING") == 0

        async def work():
            async with SchedulerClient(cluster["address"], token) as sched:
                pg = await sched.create_placement_group("m-pg", [{"CPU": 1, "GPU": 1}], "PACK")
                await sched.wait_placement_group(pg.id, timeout=60)
                infos = await sched.create_workers([common_pb2.WorkerSpec(
                    name="m-0", group="m", placement_group_id=pg.id, bundle_index=0, num_gpus=1,
                    num_cpus=1, rank=0, world_size=1)])
                infos = await sched.wait_workers([i.id for i in infos], timeout=120)
            info = infos[0]
            client = WorkerClient(f"{info.node_address}:{info.port}", token, rank=0, worker_id=info.id)
            try:
                await client.start()
                await client.construct(("collections.Counter", ("abracadabra",), {}))
                assert (await client.call("most_common", (1,))) == [("a", 5)]
                await client.call("update", ("x" * 4096,))
                with pytest.raises(errors.RemoteError) as raised:
                    await client.call("subtract", (5,))  # TypeError in the worker
                assert raised.value.remote_type == "TypeError" and raised.value.rank == 0
            finally:
                await client.close()
            return info

        info = arun(work(), timeout=180)
        text = _scrape(metrics_url, token)
        who = {"worker_id": info.id, "name": "m-0", "group": "m", "rank": "0"}
        assert _value(text, "podium_node_workers", state="RUNNING") == 1
        assert _value(text, "podium_worker_up", **who) == 1
        assert _value(text, "podium_worker_calls_total", **who) == 3
        assert _value(text, "podium_worker_call_errors_total", **who) == 1
        assert _value(text, "podium_worker_calls_in_flight", **who) == 0
        assert _value(text, "podium_worker_call_seconds_total", **who) > 0
        assert _value(text, "podium_worker_received_bytes_total", **who) > 4096
        assert _value(text, "podium_worker_sent_bytes_total", **who) > 0
        assert re.search(r"^# TYPE podium_worker_calls_total counter$", text, re.M)

        # The scheduler's endpoint (its HTTP port) counts workers by state.
        sched_text = _scrape(f"{cluster['http_url']}/metrics", token)
        assert _value(sched_text, "podium_scheduler_workers", state="WORKER_RUNNING") == 1
    finally:
        down = _podium("down", "--dir", str(state_dir), env=env)
        assert down.returncode == 0, down.stderr
