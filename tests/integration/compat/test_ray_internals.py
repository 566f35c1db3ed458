"""The Ray internals frameworks read (issue #49 item 9) under ``podium run``:
``global_worker``, the process modes, ``get_runtime_context()`` in the driver, an actor and a
task, and Ray's exception classes catching Podium's actor death (ray_internals_program.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROGRAM = Path(__file__).with_name("ray_internals_program.py")


def test_internals_in_driver_actor_and_task():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "4", "--",
                          sys.executable, str(PROGRAM)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "INTERNALS OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
