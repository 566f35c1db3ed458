"""Ray's concurrency groups under ``podium run`` with plain ``import ray``: a control method
in a group of its own answers while the default group of a sync and of an async actor is
full, each group keeps its own limit, and bad options are refused
(concurrency_groups_program.py asserts each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PROGRAM = Path(__file__).with_name("concurrency_groups_program.py")


def test_concurrency_groups_under_podium_run():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "4", "--",
                          sys.executable, str(PROGRAM)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "CONCURRENCY GROUPS OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
