"""The ``ray`` command under ``podium run`` (issue #49 item 9): ``ray start --head``,
``ray start --address``, ``ray status`` and ``ray stop`` as ROLL's launcher runs them, with a
plain ``import ray`` program joining the cluster they started (ray_cli_program.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROGRAM = Path(__file__).with_name("ray_cli_program.py")


def test_ray_start_status_stop_as_rolls_launcher_uses_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS", "PODIUM_TOKEN_FILE")}
    env.update(PODIUM_RAY_DIR=str(tmp_path / "ray"), PODIUM_TOKEN="ray-cli-test-token")
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--", sys.executable, str(PROGRAM)],
                         env=env, capture_output=True, text=True, timeout=300)
    try:
        assert run.returncode == 0 and "RAY CLI OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
    finally:  # whatever failed, nothing ray start started outlives the test
        subprocess.run([sys.executable, "-m", "podium.compat.raycli", "stop", "--force"], env=env,
                       capture_output=True, timeout=60)
