"""verl 0.9.1's own single-controller classes, unmodified, on Podium (Ray mode).

Each scenario is a script run in its own process under ``podium run`` (or with
``podium.compat.activate()``), the way a verl user runs a trainer: ``import ray`` there and
in every worker is Podium's stand-in. The scenarios assert what they check and print
``SCENARIO OK`` last. Needs the verl wheel: ``tools/install-verl.sh`` makes .venv-verl.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
HAVE_VERL = importlib.util.find_spec("verl") is not None
pytestmark = [pytest.mark.verl,
              pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (tools/install-verl.sh makes "
                                                       ".venv-verl with the verl 0.9.1 wheel)"),
              pytest.mark.timeout(240)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The workers import the scenarios' worker classes (verl_workers) from this folder.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env.pop("PODIUM_ADDRESS", None)
    return env


def _run(argv: list[str], **extra_env: str) -> str:
    done = subprocess.run(argv, cwd=HERE, env={**_env(), **extra_env}, check=False, capture_output=True,
                          text=True, timeout=220)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "SCENARIO OK" in done.stdout, output[-4000:]
    return output


def podium_run(script: str, *options: str, **extra_env: str) -> str:
    """Run ``podium run OPTIONS -- python SCRIPT``; by default on an embedded cluster of 16 CPUs
    and 4 (fake) GPUs."""
    options = options or ("--num-cpus", "16", "--num-gpus", "4")
    return _run([sys.executable, "-m", "podium.cli", "run", *options, "--", sys.executable, script], **extra_env)


def test_every_dispatch_mode_on_verls_ray_worker_group():
    podium_run("scenario_dispatch.py")


def test_colocated_and_fused_workers_spawn_per_role_groups():
    podium_run("scenario_colocated.py")


@pytest.mark.parametrize("mode", [(), ("--native-verl",)], ids=["ray-mode", "native"])
def test_a_remote_task_attaches_to_detached_workers_by_name(mode):
    podium_run("scenario_detached.py", "--num-cpus", "16", "--num-gpus", "4", *mode)


def test_on_a_cluster_started_elsewhere_the_workers_import_the_stand_in_too(tmp_path):
    # The node agents were started outside `podium run`: the stand-in reaches their workers
    # (and the task that attaches by name) through the workers' environment only.
    from tests.support.clusters import two_node_processes

    with two_node_processes(tmp_path, gpus_per_node=4, cpus=16) as cluster:
        podium_run("scenario_detached.py", "--address", cluster.address, PODIUM_TOKEN=cluster.token)


def test_ray_util_collective_between_verl_workers():
    podium_run("scenario_collective.py")


def test_programmatic_activation_runs_verl_in_a_notebook_style_process():
    code = ("import podium.compat\n"
            "podium.compat.activate(num_cpus=8, num_gpus=2)\n"
            "import ray\n"
            "assert ray.__podium__\n"
            "from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup\n"
            "from verl_workers import Counter\n"
            "ray.init()\n"
            "assert ray.cluster_resources()['GPU'] == 2, ray.cluster_resources()\n"
            "wg = RayWorkerGroup(RayResourcePool([1], max_colocate_count=1),\n"
            "                    RayClassWithInitArgs(cls=ray.remote(Counter), start=3))\n"
            "assert wg.add(1) == [4] and wg.ray_module() == [True]\n"
            "ray.shutdown()\n"
            "print('SCENARIO OK')\n")
    _run([sys.executable, "-c", code])


def test_outside_podium_run_import_ray_is_not_the_stand_in():
    code = ("import importlib.util\n"
            "spec = importlib.util.find_spec('ray')\n"
            "assert spec is None or 'raypath' not in (spec.origin or ''), spec\n"
            "print('SCENARIO OK')\n")
    _run([sys.executable, "-c", code])


def test_native_mode_runs_verls_workers_on_podiums_own_worker_group():
    # verl.single_controller.ray is Podium's SDK there; the same Counter, verl's DataProto.
    podium_run("scenario_native.py", "--num-cpus", "16", "--num-gpus", "4", "--native-verl")


def test_native_mode_colocated_and_fused_workers():
    # verl's create_colocated_worker_cls(_fused) + spawn, resolved to Podium's.
    podium_run("scenario_colocated.py", "--num-cpus", "16", "--num-gpus", "4", "--native-verl")


def test_outside_native_mode_verls_own_module_is_imported():
    code = ("import podium.compat\n"
            "podium.compat.activate()\n"
            "import verl.single_controller.ray as m\n"
            "assert not getattr(m, '__podium__', False) and m.RayWorkerGroup.__module__.startswith('verl.'), m\n"
            "print('SCENARIO OK')\n")
    _run([sys.executable, "-c", code])


def test_verls_dataproto_travels_as_raw_buffers_and_comes_back_as_verls_type():
    code = """
import podium.compat
podium.compat.activate()
import numpy as np
import torch
from verl import DataProto
from podium import codec

n = 1 << 16
data = DataProto.from_dict({"x": torch.arange(n, dtype=torch.float32), "m": torch.ones(n, 2)},
                           non_tensors={"tag": np.array(["a"] * n, dtype=object)}, meta_info={"step": 3})
encoded = codec.encode(data)
# The tensors are out-of-band buffers (verl's __getstate__ would torch.save them in-band).
assert sum(b.nbytes for b in encoded.buffers) == sum(t.nbytes for t in data.batch.values())
tensors_only = codec.encode(DataProto.from_dict({"x": data.batch["x"]}))
assert len(tensors_only.skeleton) < 4096, len(tensors_only.skeleton)  # names, dtypes, shapes
back = codec.loads(codec.dumps(data))
assert type(back) is DataProto and back.meta_info == {"step": 3} and len(back) == n
assert torch.equal(back.batch["x"], data.batch["x"]) and torch.equal(back.batch["m"], data.batch["m"])
assert back.batch.batch_size == data.batch.batch_size and list(back.non_tensor_batch["tag"][:2]) == ["a", "a"]
print("SCENARIO OK")
"""
    _run([sys.executable, "-c", code])


def test_verls_main_ppo_task_runner_runs_on_podium_as_far_as_a_cpu_allows():
    # verl's trainer entry and its TaskRunner, unmodified, under `podium run`, with verl's CPU
    # platform plugin in every process (see scenario_main_ppo.py for where a CPU stops it).
    podium_run("scenario_main_ppo.py", "--num-cpus", "8", "--num-gpus", "1",
               VERL_USE_EXTERNAL_MODULES="verl_cpu_platform", VERL_PLATFORM="cpu")


def test_verls_ray_init_py_executable_starts_the_task_runner_and_workers_under_that_command(tmp_path):
    # ppo_trainer.yaml's ray_kwargs.ray_init.runtime_env.py_executable, a command prefix ending
    # in an interpreter as verl's GPU examples give (`uv run ... python`): a wrapper that notes
    # each process it starts. The TaskRunner and verl's workers (created by the TaskRunner)
    # inherit it, and get as far as without it (scenario_main_ppo.py).
    marker = tmp_path / "started"
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$PODIUM_VIA $PODIUM_WORKER_ID" >> {marker}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    podium_run("scenario_main_ppo.py", "--num-cpus", "8", "--num-gpus", "1",
               VERL_USE_EXTERNAL_MODULES="verl_cpu_platform", VERL_PLATFORM="cpu",
               SCENARIO_PY_EXECUTABLE=f"env PODIUM_VIA=wrapped {wrapper}")
    started = marker.read_text().splitlines()
    # The TaskRunner, then at least one ActorRolloutRefWorker, each a worker Podium started.
    assert len(started) >= 2 and all(line.startswith("wrapped w-") for line in started), started


@pytest.mark.parametrize("mode", [(), ("--native-verl",)], ids=["ray-mode", "native"])
def test_verls_checkpoint_engine_manager_updates_the_rollout_weights(mode):
    # The "naive" backend; verl's nccl engine imports cupy (and needs CUDA) at import.
    podium_run("scenario_checkpoint_engine.py", "--num-cpus", "16", "--num-gpus", "4", *mode)


@pytest.mark.parametrize("mode", [(), ("--native-verl",)], ids=["ray-mode", "native"])
def test_a_non_blocking_concat_call_gives_verls_data_proto_future(mode):
    # verl's own test_decorator_on_cpu shape: blocking=False DP_COMPUTE_PROTO (sync and async
    # def) and an nd-mesh TensorDict method, isinstance-checked against verl's classes.
    podium_run("scenario_futures.py", "--num-cpus", "16", "--num-gpus", "4", *mode)


def test_actors_are_built_while_remote_returns_so_verl_workers_may_rendezvous_in_init():
    # verl's RayWorkerGroup creates its workers one at a time; Joined's constructor joins
    # torch.distributed, so rank 0 waits there for rank 1 (a deadlock if .remote() waited).
    podium_run("scenario_construct.py")


def test_collective_nccl_groups_connect_at_their_first_operation_as_in_ray():
    # One worker group's blocking init, then the other's: an eager rendezvous would wait forever.
    podium_run("scenario_collective_pairs.py")


@pytest.mark.parametrize("mode", [(), ("--native-verl",)], ids=["ray-mode", "native"])
def test_verls_agent_loop_generates_through_its_llm_server_manager_and_load_balancer(mode):
    # verl's trainer rollout path (LLMServerManager, AgentLoopManager, AgentLoopWorker,
    # LLMServerClient with its load-balancer handle): handles passed into actors and returned
    # from them, refs awaited in async actors and in the driver (scenario_agent_loop.py).
    podium_run("scenario_agent_loop.py", "--num-cpus", "16", "--num-gpus", "4", *mode,
               VERL_USE_EXTERNAL_MODULES="verl_cpu_rollout")
