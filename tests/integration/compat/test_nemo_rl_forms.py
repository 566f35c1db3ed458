"""Ray forms NeMo-RL's GRPO entry point uses that the stand-in gained for it (issue #49 item
12), each run with plain ``import ray`` under ``podium run`` (nemo_rl_forms_program.py). They do
not need NeMo-RL: tools/run-nemo-rl.sh runs its entry point from a checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROGRAM = Path(__file__).with_name("nemo_rl_forms_program.py")


def test_memory_summary_and_the_other_nemo_rl_forms():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "2", "--",
                          sys.executable, str(PROGRAM)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "NEMO FORMS OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
