"""``num_returns="streaming"`` as a Ray program runs it: plain ``import ray`` under ``podium run``
(streaming_program.py asserts each case and prints STREAMING OK)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PROGRAM = Path(__file__).with_name("streaming_program.py")


def test_streaming_generators_under_podium_run():
    """Tasks, sync and async actor methods (generators stream by default, and with
    num_returns="streaming"), sync and async iteration; items arrive while the producer waits
    for what only the consumer does after item 0; an error after k items; an actor that dies
    mid-stream; a dropped generator closed at the worker (its actor free again); the bound of
    _generator_backpressure_num_objects; retried streams refused."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "8", "--",
                          sys.executable, str(PROGRAM)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "STREAMING OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
