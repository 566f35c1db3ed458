"""The README's main job: examples/quickstart.py runs on CPU and its reward rises."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "quickstart.py"


@pytest.mark.timeout(180)
def test_quickstart_reward_rises():
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rewards = [float(x) for x in re.findall(r"mean reward ([0-9.]+)", proc.stdout)]
    assert len(rewards) == 25
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, proc.stdout
