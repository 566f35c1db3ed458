"""Ray's ``ray._private.log_monitor.LogMonitor`` over Podium's worker logs, as ROLL's launcher
subclasses and runs it (issue #49 item 12), with a plain ``import ray`` program on a cluster
that Podium's ``ray start`` made (ray_log_monitor_program.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROGRAM = Path(__file__).with_name("ray_log_monitor_program.py")


def test_rolls_log_monitor_follows_each_actors_output_under_its_name(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS", "PODIUM_TOKEN_FILE")}
    env.update(PODIUM_RAY_DIR=str(tmp_path / "ray"), PODIUM_TOKEN="log-monitor-test-token")
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--", sys.executable, str(PROGRAM)],
                         env=env, capture_output=True, text=True, timeout=300)
    try:
        assert run.returncode == 0 and "LOG MONITOR OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
        # print_to_stdstream printed each batch as Ray's driver does, the actor's name first.
        assert "(alpha pid=" in run.stdout and "alpha out 0" in run.stdout, run.stdout[-4000:]
        assert "(beta pid=" in run.stderr and "beta err 1" in run.stderr, run.stderr[-4000:]
    finally:  # whatever failed, nothing ray start started outlives the test
        subprocess.run([sys.executable, "-m", "podium.compat.raycli", "stop", "--force"], env=env,
                       capture_output=True, timeout=60)
