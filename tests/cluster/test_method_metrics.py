"""Per-method metrics of a running cluster: ``podium_method_call_seconds`` and the
``podium_method_*_bytes_total`` counters in the node agent's /metrics, summed over the
ranks of a group; the bound on method names; and the Grafana dashboard's queries against
what the agent and the scheduler really answer.

``podium up`` starts the cluster; three workers are started through the scheduler (two
ranks of group ``m``, one of group ``many``) and called directly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest

from podium.worker.host.methodstats import MAX_METHODS, OTHER
from tests.support import dashboards

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def _podium(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "podium.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def _scrape(url: str, token: str) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.read().decode()


_SAMPLE = re.compile(r'^(podium_method_\w+)\{([^}]*)\} (\S+)$', re.M)


def _method_samples(text: str) -> dict[tuple[str, str, str, str], float]:
    """(series, group, method, le) -> value of the per-method samples."""
    out = {}
    for series, labels, value in _SAMPLE.findall(text):
        pairs = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
        assert pairs["node"], labels
        out[(series, pairs["group"], pairs["method"], pairs.get("le", ""))] = float(value)
    return out


def test_method_histograms_sum_ranks_bound_names_and_feed_the_dashboard(tmp_path, token, arun):
    from podium.scheduler.client import SchedulerClient
    from podium.v1 import common_pb2
    from podium.worker.caller.client import WorkerClient

    state_dir = tmp_path / "local"
    env = dict(os.environ, PODIUM_TOKEN=token)
    up = _podium("up", "--dir", str(state_dir), "--nodes", "1", "--gpus-per-node", "1", "--cpus-per-node", "8",
                 "--port", "0", "--http-port", "0", env=env)
    assert up.returncode == 0, up.stderr
    try:
        cluster = json.loads((state_dir / "cluster.json").read_text())
        node = cluster["nodes"][0]
        metrics_url = f"http://{node['address']}:{node['metrics_port']}/metrics"
        many = type("Many", (), {f"m{i:03d}": (lambda self, i=i: i) for i in range(100)})

        async def work():
            async with SchedulerClient(cluster["address"], token) as sched:
                pg = await sched.create_placement_group("mm-pg", [{"CPU": 1}] * 3, "PACK")
                await sched.wait_placement_group(pg.id, timeout=60)
                specs = [common_pb2.WorkerSpec(name=f"m-{r}", group="m", placement_group_id=pg.id,
                                               bundle_index=r, num_cpus=1, rank=r, world_size=2) for r in (0, 1)]
                specs.append(common_pb2.WorkerSpec(name="many-0", group="many", placement_group_id=pg.id,
                                                   bundle_index=2, num_cpus=1, rank=0, world_size=1))
                infos = await sched.create_workers(specs)
                infos = await sched.wait_workers([i.id for i in infos], timeout=120)
            by_name = {info.spec.name: info for info in infos}
            # rank 0: update x3, most_common x1; rank 1: update x2, most_common x2
            for name, updates, commons in (("m-0", 3, 1), ("m-1", 2, 2)):
                info = by_name[name]
                client = WorkerClient(f"{info.node_address}:{info.port}", token, worker_id=info.id)
                try:
                    await client.start()
                    await client.construct(("collections.Counter", ("abracadabra",), {}))
                    for _ in range(updates):
                        await client.call("update", ("x" * 1000,))
                    for _ in range(commons):
                        assert (await client.call("most_common", (1,)))[0][1] >= 5
                finally:
                    await client.close()
            info = by_name["many-0"]
            client = WorkerClient(f"{info.node_address}:{info.port}", token, worker_id=info.id)
            try:
                await client.start()
                await client.construct((many, (), {}))
                for i in range(100):
                    assert await client.call(f"m{i:03d}") == i
            finally:
                await client.close()

        arun(work(), timeout=240)
        text = _scrape(metrics_url, token)
        samples = _method_samples(text)
        assert re.search(r"^# TYPE podium_method_call_seconds histogram$", text, re.M)

        def count(group, method):
            return samples[("podium_method_call_seconds_count", group, method, "")]

        # Two ranks, one series per method: the ranks are summed.
        assert (count("m", "update"), count("m", "most_common"), count("m", "__init__")) == (5, 3, 2)
        assert samples[("podium_method_received_bytes_total", "m", "update", "")] > 5 * 1000
        assert samples[("podium_method_sent_bytes_total", "m", "most_common", "")] > 0
        assert not any(k[1] == "m" and k[2] not in ("update", "most_common", "__init__") for k in samples)
        # Each histogram: cumulative buckets ending in +Inf, which equals its count.
        for (series, group, method, le), value in samples.items():
            if series != "podium_method_call_seconds_count":
                continue
            buckets = [v for (s, g, m, b), v in samples.items()
                       if s == "podium_method_call_seconds_bucket" and (g, m) == (group, method)]
            assert buckets == sorted(buckets) and buckets[-1] == value
            assert samples[("podium_method_call_seconds_bucket", group, method, "+Inf")] == value
        # 100 method names: 64 series (the constructor and 63 methods), the rest in "other".
        methods = {k[2] for k in samples if k[1] == "many" and k[0] == "podium_method_call_seconds_count"}
        assert len(methods) == MAX_METHODS + 1 and OTHER in methods
        assert sum(count("many", m) for m in methods) == 101
        assert count("many", OTHER) == 100 - (MAX_METHODS - 1)

        # Every series the Grafana dashboard reads has samples in these real scrapes.
        sched_text = _scrape(f"{cluster['http_url']}/metrics", token)
        answered = dashboards.sample_names(text) | dashboards.sample_names(sched_text)
        read = set().union(*map(dashboards.metric_names, dashboards.queries(dashboards.load())))
        assert read and read <= answered, f"no samples of {sorted(read - answered)}"
    finally:
        down = _podium("down", "--dir", str(state_dir), env=env)
        assert down.returncode == 0, down.stderr
