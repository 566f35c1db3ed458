"""examples/grpo_async.py runs briefly on CPU: the reward rises and every sample's
staleness (policy versions behind the trained one) stays within --max-staleness, for the
synchronous loop (0, drain) and an overlapped one (2, abort: aborted groups are resubmitted)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from tests.support.rollout_kit import vllm_marks

pytestmark = [*vllm_marks, pytest.mark.timeout(400)]

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "grpo_async.py"
STEPS = 15
LINE = re.compile(r"^step +(\d+)  reward ([0-9.]+)  staleness (\d+) \(mean ([0-9.]+)\).* aborted (\d+)  samples/s",
                  re.M)


@pytest.mark.parametrize("staleness,policy", [(0, "drain"), (2, "abort")])
def test_reward_rises_and_staleness_stays_bounded(staleness, policy):
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--max-staleness", str(staleness),
                           "--update-policy", policy], capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [(int(s), float(r), int(m), float(mean)) for s, r, m, mean, _ in LINE.findall(proc.stdout)]
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)), proc.stdout
    assert all(r[2] <= staleness for r in rows), proc.stdout
    if staleness:  # the replicas really ran ahead of the trainer
        assert any(r[2] > 0 for r in rows), proc.stdout
    first, last = sum(r[1] for r in rows[:3]) / 3, sum(r[1] for r in rows[-3:]) / 3
    assert last > first + 0.1, proc.stdout
    assert f"max staleness {max(r[2] for r in rows)}" in proc.stdout
