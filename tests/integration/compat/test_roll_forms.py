"""The small Ray internals ROLL imports (issue #49 item 12) under ``podium run``:
``_Timer``, ``has_async_methods`` on ``__ray_metadata__.modified_class``, ``profiling.profile``
in the timeline, ``RemoteFunctionNoArgs`` (roll_forms_program.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROGRAM = Path(__file__).with_name("roll_forms_program.py")


def test_rolls_timer_async_check_profile_spans_and_typing_class():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "4", "--",
                          sys.executable, str(PROGRAM)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "ROLL FORMS OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
