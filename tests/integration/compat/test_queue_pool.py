"""``ray.util.queue.Queue`` (a queue held by an actor, its handle passed into other actors, an
async get in an actor and in the driver) and ``ray.util.ActorPool``: a plain ``import ray``
program (queue_pool_program.py) under ``podium run``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

HERE = Path(__file__).parent

EXPECTED = {
    "empty": "True 0 0",
    "full": "True 3",
    # Ray's Full / Empty, which are the standard library's queue.Full / queue.Empty too.
    "put_nowait when full": "Full True",
    "put timeout when full": "Full True",
    "put_nowait_batch too many": "Full True",
    "gets": "1 2 3",
    "get_nowait when empty": "Empty True",
    "get timeout when empty": "Empty True",
    "get_nowait_batch too many": "Empty True",
    "get_nowait_batch": "['a', 'b']",
    "cross-process": "[('item', 0), ('item', 1), ('item', 2), ('item', 3), ('item', 4)] 5",
    "async get in actor": "[0, 10, 20]",
    "driver async": "x",
    "after shutdown": "True",
    "map": "[0, 2, 4, 6, 8, 10, 12, 14]",
    "map_unordered": "[0, 2, 4, 6, 8, 10, 12, 14]",
    "has_free while busy": "False",
    "submit/get_next": "[0, 2, 4, 6, 8]",
    "get_next_unordered": "[8, 42]",
    "pop_idle": "True True",
    "one actor left": "[2, 4, 6]",
    "push twice": "True",
    "has_next at end": "False",
}


def test_queue_and_actor_pool_under_podium_run():
    done = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "8", "--",
                           sys.executable, "queue_pool_program.py"],
                          cwd=HERE, env=dict(os.environ), capture_output=True, text=True, timeout=280)
    assert done.returncode == 0 and "PROGRAM OK" in done.stdout, (done.stdout + done.stderr)[-5000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert {k: lines.get(k) for k in EXPECTED} == EXPECTED
