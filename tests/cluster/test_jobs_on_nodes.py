"""A submitted job's driver placed on the node that holds its entrypoint resources (a
scheduler and two node agents, as processes): it runs there through that node's agent, with
the bundle's GPU, its log streams through the agent while it runs, its reservation is the
scheduler's while it runs, the actors it creates start under the job's py_executable, stop
ends it and frees everything, and a job that fits no node is
refused at once with the reason."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.support.clusters import TWO_NODES, two_node_processes
from tests.support.proctable import alive

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

DRIVER = ("python -c \"import os, sys, time; import ray; ray.init(); "
          "print('DRIVER', os.getcwd(), os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True); "
          "a = ray.remote(num_cpus=1)(type('A', (), {'f': lambda self: os.environ.get('VIA')})).remote(); "
          "print('ACTOR', ray.get(a.f.remote()), flush=True); "
          "time.sleep(600)\"")


class _Http:
    def __init__(self, port: int, token: str) -> None:
        self.base, self.token = f"http://127.0.0.1:{port}", token

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
        request = urllib.request.Request(self.base + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def wait(self, what, timeout: float = 150.0):
        deadline = time.monotonic() + timeout
        while True:
            found = what()
            if found:
                return found
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.3)


def test_a_job_runs_on_the_node_that_holds_its_entrypoint_resources(tmp_path):
    second = TWO_NODES[1]
    with two_node_processes(tmp_path, gpus_per_node=2, cpus=4) as cluster:
        http = _Http(cluster.http_port, cluster.token)
        http.wait(lambda: len(http.call("GET", "/v1/nodes")[1].get("nodes", [])) == 2)
        # More GPUs than any node has: refused at once, with the scheduler's reason.
        status, text = http.call("POST", "/api/jobs/", {"entrypoint": "true", "entrypoint_num_gpus": 8})
        assert status == 400 and "fit no node" in text, text
        status, text = http.call("POST", "/api/jobs/", {"entrypoint": "true", "entrypoint_memory": 10})
        assert status == 400 and "entrypoint_memory" in text, text

        status, doc = http.call("POST", "/api/jobs/", {
            "entrypoint": DRIVER, "submission_id": "placed", "entrypoint_num_cpus": 1,
            "entrypoint_num_gpus": 1, "entrypoint_resources": {f"node:{second}": 1},
            # The driver's actors start under the job's py_executable (a command prefix).
            "runtime_env": {"py_executable": f"env VIA=job-interpreter {sys.executable}"}})
        assert status == 200, doc
        logs = http.wait(lambda: (lambda t: t if "ACTOR job-interpreter" in t else "")(
            http.call("GET", "/api/jobs/placed/logs")[1]["logs"]))
        job = http.call("GET", "/api/jobs/placed")[1]
        assert job["status"] == "RUNNING" and job["driver_info"]["node_ip_address"] == second
        driver_line = next(line for line in logs.splitlines() if line.startswith("DRIVER"))
        _, cwd, gpus = driver_line.split()
        assert cwd.startswith(str(tmp_path / second / "drivers" / "placed")) and gpus in ("0", "1")
        groups = http.call("GET", "/v1/placement")[1]["placement_groups"]
        assert any(g["name"] == "job:placed" for g in groups)  # the scheduler accounts its resources
        pid = int(job["driver_info"]["pid"])
        assert alive(pid)

        status, doc = http.call("POST", "/api/jobs/placed/stop")
        assert status == 200 and doc["stopped"] is True
        http.wait(lambda: http.call("GET", "/api/jobs/placed")[1]["status"] == "STOPPED")
        http.wait(lambda: not alive(pid))
        http.wait(lambda: not http.call("GET", "/v1/placement")[1]["placement_groups"])
        http.wait(lambda: not (tmp_path / second / "drivers" / "placed").exists())  # its folder goes
