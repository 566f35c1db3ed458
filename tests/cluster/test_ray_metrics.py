"""``ray.util.metrics`` with plain ``import ray`` under ``podium run``: an actor's and a task's
Counter, Gauge and Histogram samples appear on their node agent's ``/metrics`` with their
tags and ``worker_id`` (``podium up`` gives agents ``--metrics-port 0``)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PROGRAM = pathlib.Path(__file__).with_name("ray_metrics_program.py")


def _podium(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "podium.cli", *args], env=env, capture_output=True,
                          text=True, timeout=180)


def _sample(lines: list[str], prefix: str, ending: str = "") -> float:
    found = [line for line in lines if line.startswith(prefix) and line.rsplit(" ", 1)[0].endswith(ending)]
    assert len(found) == 1, (prefix, lines)
    return float(found[0].rsplit(" ", 1)[1])


def test_application_metrics_reach_the_node_agents_endpoint(tmp_path, token):
    state_dir = tmp_path / "local"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    env["PODIUM_TOKEN"] = token
    up = _podium("up", "--dir", str(state_dir), "--nodes", "1", "--gpus-per-node", "0",
                 "--port", "0", "--http-port", "0", env=env)
    assert up.returncode == 0, up.stderr
    try:
        cluster = json.loads((state_dir / "cluster.json").read_text())
        node = cluster["nodes"][0]
        run = _podium("run", "--address", cluster["address"], "--", sys.executable, str(PROGRAM),
                      env={**env, "METRICS_URL": f"http://{node['address']}:{node['metrics_port']}/metrics"})
        assert run.returncode == 0 and "METRICS OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
        lines = run.stdout.splitlines()
        assert "# TYPE app_steps counter" in lines and "# TYPE app_phase gauge" in lines
        assert "# TYPE app_step_seconds histogram" in lines
        assert _sample(lines, 'app_steps{phase="train",worker_id=') == 3.0
        assert _sample(lines, 'app_steps{phase="eval",worker_id=') == 2.0
        assert _sample(lines, 'app_phase{phase="train",worker_id=') == 1.0
        assert _sample(lines, 'app_phase{phase="eval",worker_id=') == 0.0
        assert [_sample(lines, 'app_step_seconds_bucket{phase="train",worker_id=', f'le="{le}"}}')
                for le in ("0.1", "1.0", "10.0", "+Inf")] == [1.0, 2.0, 3.0, 4.0]
        assert _sample(lines, 'app_step_seconds_sum{phase="train"') == 55.55
        assert _sample(lines, 'app_step_seconds_count{phase="train"') == 4.0
        assert _sample(lines, "app_task_runs{worker_id=") == 1.0
    finally:
        down = _podium("down", "--dir", str(state_dir), env=env)
        assert down.returncode == 0, down.stderr
