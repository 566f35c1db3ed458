"""An actor's failure that another actor lets through reaches the driver as its cause, as Ray's
``RayTaskError`` does (it never nests one in another): slime's rollout manager calls its SGLang
engine actors' ``init`` with ``ray.get`` in its own ``__init__``, and the driver's error must name
the engine's ``RuntimeError`` (issue #49 item 12), with the engine's traceback once."""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = r"""
import ray
ray.init()

@ray.remote
class Engine:
    def init(self):
        raise RuntimeError("no usable accelerator in the engine")

@ray.remote
class Manager:
    def __init__(self):
        self.engine = Engine.remote()

    def start(self):
        return ray.get(self.engine.init.remote())  # not caught: the engine's error goes on

@ray.remote
def run_manager():
    return ray.get(Manager.remote().start.remote())

for ref in (Manager.remote().start.remote(), run_manager.remote()):
    try:
        ray.get(ref)
        raise AssertionError("the engine's failure was lost")
    except ray.exceptions.RayTaskError as exc:
        text = str(exc)
        assert exc.remote_type == "RuntimeError", exc.remote_type
        assert text.startswith("RuntimeError in "), text
        assert text.count(", in init\n") == 1, text  # the engine's frame, once
        assert "in start" in text, text  # the manager's own frames are kept
        assert isinstance(exc, RuntimeError)  # as Ray's RayTaskError(RuntimeError)

@ray.remote
def bad_value():
    raise ValueError("caught by type")

try:
    ray.get(bad_value.remote())
except ValueError as exc:  # what Ray users write around ray.get
    assert isinstance(exc, ray.exceptions.RayTaskError) and "caught by type" in str(exc)
print("NESTED OK")
"""


def test_an_error_let_through_by_an_actor_reaches_the_driver_as_its_cause():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "8", "--",
                          sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "NESTED OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
