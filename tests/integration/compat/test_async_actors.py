"""Async actors like Ray's under ``podium run`` with plain ``import ray`` and
``PODIUM_LIVENESS_SECONDS=2`` (async_actors_program.py): an ``async __init__`` that blocks its
loop past the liveness bound is waited for; a blocked default group stops neither the group
"ctl" nor liveness; a SIGSTOPped async actor is still found; a constructor that never
returns is bounded by the caller through ``__ray_ready__``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PROGRAM = Path(__file__).with_name("async_actors_program.py")


def test_async_actors_under_podium_run():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    env["PODIUM_LIVENESS_SECONDS"] = "2"
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "4", "--",
                          sys.executable, str(PROGRAM)], env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "ASYNC ACTORS OK" in run.stdout, out[-5000:]
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    expected = {
        "slow constructor ready": "True",
        "slow constructor answers": "True",
        "ctl answers while default blocked": "True",
        "blocked call finished": "True",
        "stopped actor's call": "UnresponsiveError",
        "never-ready constructor": "DeadlineExceededError",
    }
    assert {k: lines.get(k) for k in expected} == expected, out[-5000:]
