"""podium.compat.ray: a Ray-style program runs unchanged (one import) on a two-node loopback
cluster, and the module's small pieces behave as Ray's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import podium.compat.ray as ray
from tests.support.clusters import two_node_processes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PROGRAM = Path(__file__).with_name("ray_style_program.py")


def test_ray_style_program_runs_on_two_nodes(tmp_path):
    with two_node_processes(tmp_path, gpus_per_node=2) as cluster:
        env = dict(os.environ, PODIUM_ADDRESS=cluster.address, PODIUM_TOKEN=cluster.token,
                   PYTHONPATH=os.pathsep.join([str(PROGRAM.parent), os.environ.get("PYTHONPATH", "")]))
        run = subprocess.run([sys.executable, str(PROGRAM)], env=env, capture_output=True, text=True,
                             timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert lines["counter"] == "15"
    assert lines["squares"] == str(sum(i * i for i in range(20)))
    assert lines["group sums"] == "[3000.0, 3000.0] [2000.0, 2000.0]"
    assert lines["second controller"] == "115"
    assert lines["cpus taken"] == "4.0"
    assert lines["cpus back"] == "True"
    assert lines["after kill"] == "gone"
    assert "ray.data is not provided" in lines["unsupported"]


def test_unsupported_names_say_what_to_use():
    with pytest.raises(NotImplementedError, match="ray.serve .*actor"):
        ray.serve
    with pytest.raises(NotImplementedError, match="README"):
        ray.some_future_api
    with pytest.raises(AttributeError):
        ray.__wrapped__
    with pytest.raises(NotImplementedError, match="runtime_env"):
        ray.init(runtime_env={"conda": "env"})
    assert ray.exceptions.RayActorError.__name__ == "WorkerDiedError"
    assert ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy is \
        ray.util.PlacementGroupSchedulingStrategy


SMALL_FORMS = Path(__file__).with_name("ray_small_forms.py")


def test_small_forms_of_verl_skyrl_and_openrlhf_under_podium_run():
    """resources=None/{}, ray._private.services.get_node_ip_address, is_initialized in workers,
    async def __init__, podium run's sizing for the first call without ray.init, and missing
    names that are AttributeErrors too (ray_small_forms.py asserts each)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "6", "--num-gpus", "1", "--",
                          sys.executable, str(SMALL_FORMS)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "SMALL FORMS OK" in run.stdout, (run.stdout + run.stderr)[-4000:]


CUSTOM_RESOURCES = Path(__file__).with_name("custom_resources_program.py")


def test_custom_resources_under_podium_run():
    """ray.init(resources=...) on the embedded node; actors, tasks and placement group bundles
    take custom resources, memory and node:<address>; infeasible asks fail at once, naming the
    resource (custom_resources_program.py asserts each)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "8", "--",
                          sys.executable, str(CUSTOM_RESOURCES)], env=env, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0 and "CUSTOM RESOURCES OK" in run.stdout, (run.stdout + run.stderr)[-4000:]


CAPTURE = Path(__file__).with_name("capture_program.py")


def test_placement_group_capture_under_podium_run():
    """placement_group_capture_child_tasks (strategy and option forms): actors, tasks and their
    children land in the caller's group; get_current_placement_group() inside an actor; an
    explicit PlacementGroupSchedulingStrategy(None) escapes (capture_program.py asserts each)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "8", "--",
                          sys.executable, str(CAPTURE)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "CAPTURE OK" in run.stdout, (run.stdout + run.stderr)[-4000:]


NUM_RETURNS = Path(__file__).with_name("num_returns_program.py")


def test_num_returns_under_podium_run():
    """num_returns=N on tasks (decorator and .options) and actor methods (ray.method and
    .options), also through a handle passed to another actor; wrong lengths and failures reach
    every ref; bad counts are refused (num_returns_program.py asserts each)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "8", "--",
                          sys.executable, str(NUM_RETURNS)], env=env, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0 and "NUM RETURNS OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
