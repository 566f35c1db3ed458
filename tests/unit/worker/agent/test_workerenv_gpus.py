"""RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES in the environment the agent computes for a
worker: set (by the actor's runtime_env, or in the agent's own environment, as an embedded
cluster inherits the driver's), CUDA_VISIBLE_DEVICES is not narrowed and ray.get_gpu_ids()
still names the assigned GPUs; unset, nothing changes."""

from __future__ import annotations

import pytest

import podium.compat.ray as ray
from podium.worker.agent.workerenv import ASSIGNED_GPUS, NOSET_CUDA_VISIBLE_DEVICES, worker_env

ASSIGNED = {"CUDA_VISIBLE_DEVICES": "2", "RANK": "0"}  # what the scheduler gives a worker of GPU 2


def _env(base: dict, env: dict) -> dict:
    return worker_env(base, env, token="t", scheduler="127.0.0.1:1")


def test_default_narrows_to_the_assigned_gpus() -> None:
    out = _env({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, ASSIGNED)
    assert out["CUDA_VISIBLE_DEVICES"] == "2" and ASSIGNED_GPUS not in out


def test_noset_in_the_actors_env_leaves_every_gpu_of_the_node_visible() -> None:
    out = _env({}, {**ASSIGNED, NOSET_CUDA_VISIBLE_DEVICES: "1"})
    assert "CUDA_VISIBLE_DEVICES" not in out  # every GPU the node has
    assert out[ASSIGNED_GPUS] == "2"


def test_noset_in_the_agents_env_keeps_the_agents_own_gpus() -> None:
    # An agent limited to GPUs 4-7 (Slurm, or CUDA_VISIBLE_DEVICES on the agent) gives them all.
    out = _env({"CUDA_VISIBLE_DEVICES": "4,5,6,7", NOSET_CUDA_VISIBLE_DEVICES: "true"}, ASSIGNED)
    assert out["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and out[ASSIGNED_GPUS] == "2"


def test_an_empty_value_is_unset_and_a_stale_assignment_is_dropped() -> None:
    out = _env({}, {**ASSIGNED, NOSET_CUDA_VISIBLE_DEVICES: "", ASSIGNED_GPUS: "9"})
    assert out["CUDA_VISIBLE_DEVICES"] == "2" and ASSIGNED_GPUS not in out


def test_get_gpu_ids_reads_the_assignment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    monkeypatch.delenv(ASSIGNED_GPUS, raising=False)
    assert ray.get_gpu_ids() == [1, 3]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv(ASSIGNED_GPUS, "2")
    assert ray.get_gpu_ids() == [2]
    monkeypatch.setenv(ASSIGNED_GPUS, "")  # a CPU-only worker with NOSET
    assert ray.get_gpu_ids() == []
