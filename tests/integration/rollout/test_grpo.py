"""The second job: examples/grpo_vllm.py runs to the end on CPU and its reward rises."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from tests.support.rollout_kit import vllm_marks

pytestmark = [*vllm_marks, pytest.mark.timeout(400)]

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "grpo_vllm.py"
STEPS = 12


def test_grpo_reward_rises():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS)], capture_output=True, text=True,
                          timeout=380)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rewards = [float(x) for x in re.findall(r"reward ([0-9.]+)  kl", proc.stdout)]
    assert len(rewards) == STEPS, proc.stdout
    kls = [float(x) for x in re.findall(r"kl ([0-9.]+)", proc.stdout)]
    assert all(k >= 0 for k in kls)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, proc.stdout
    # Engine log-probs match the actor's recomputation: the sync really took the new weights.
    gaps = [float(x) for x in re.findall(r"\|logp-old\| ([0-9.e+-]+)", proc.stdout)]
    assert max(gaps) < 1e-2, proc.stdout
