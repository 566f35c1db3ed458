"""A finished task holds no room in its placement group bundle (issue #49 item 12, ROLL's
resource manager): a ``num_gpus=1`` task runs in a bundle of one GPU, then actors asking for
GPU in that bundle are placed there, as in Ray. Podium keeps the task's worker for the next
task; it is stopped when an actor asks for its room."""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = r"""
import os
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
ray.init()
pg = ray.util.placement_group([{"GPU": 1, "CPU": 2}])
ray.get(pg.ready())

@ray.remote
def visible():
    return os.environ["CUDA_VISIBLE_DEVICES"].split(",")

# ROLL's ResourceManager: one task taking the bundle's whole GPU, twice (the pool reuses its worker).
for _ in range(2):
    assert len(ray.get(visible.options(placement_group=pg, num_gpus=1).remote())) == 1

@ray.remote
class Holder:
    def ping(self):
        return "pong"

strategy = PlacementGroupSchedulingStrategy(placement_group=pg)
holders = [Holder.options(scheduling_strategy=strategy, num_cpus=0.01, num_gpus=0.01).remote() for _ in range(3)]
assert ray.get([h.ping.remote() for h in holders]) == ["pong"] * 3
# The bundle's room is the actors' now: a task asking for the whole GPU finds none, and is refused
# at once, naming the bundle (its idle worker is gone; the actors are not taken).
try:
    ray.get(visible.options(placement_group=pg, num_gpus=1).remote(), timeout=120)
    raise AssertionError("a task took a GPU the actors hold")
except Exception as exc:
    assert "full" in str(exc), exc
assert ray.get([h.ping.remote() for h in holders]) == ["pong"] * 3
print("ROOM OK")
"""


def test_actors_take_the_room_a_finished_task_held_in_its_bundle():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "4", "--num-gpus", "1", "--",
                          sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ROOM OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
