"""`podium slurm` pieces that need no Slurm: the allocation's GPUs, the environment, bad input."""

from __future__ import annotations

import argparse

import pytest

from podium import errors
from podium.cli import slurm, slurmnode
from podium.cli.main import SUBCOMMANDS
from podium.worker.agent.gpufilter import VisibleGpus, parse_visible_devices
from podium.worker.agent.gpus import FakeProvider


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", ()), ("NoDevFiles", ()), ("-1", ()),
    ("0", ("0",)), (" 1, 3 ", ("1", "3")), ("GPU-abc,MIG-def", ("GPU-abc", "MIG-def")),
])
def test_visible_devices_parse(value, expected):
    assert parse_visible_devices(value) == expected


@pytest.mark.parametrize("value", ["a", "0,,1", "1,1", "0;1"])
def test_visible_devices_reject(value):
    with pytest.raises(errors.InvalidArgumentError):
        parse_visible_devices(value)


def test_visible_gpus_keep_indices_and_uuids():
    inner = FakeProvider(4, node_id="n")
    uuid2 = inner.gpus()[2].uuid
    kept = VisibleGpus(inner, ("3", uuid2[:12], "0"))
    # NVML index order, indices unchanged: CUDA_VISIBLE_DEVICES for a worker names the same GPU.
    assert [g.index for g in kept.gpus()] == [0, 2, 3]
    assert [g.index for g in VisibleGpus(inner, None).gpus()] == [0, 1, 2, 3]
    assert VisibleGpus(inner, ()).gpus() == []


def test_job_from_env():
    job = slurm.job_from_env({"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "3", "SLURMD_NODENAME": "gpu7"})
    assert (job.job_id, job.nodes, job.node_name) == ("42", 3, "gpu7")
    with pytest.raises(errors.FailedPreconditionError, match="sbatch"):
        slurm.job_from_env({})
    with pytest.raises(errors.InvalidArgumentError):
        slurm.job_from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "x"})


@pytest.mark.parametrize("argv, message", [
    ([], "controller command"),
    (["--"], "controller command"),
    (["--register-timeout", "0", "--", "true"], "register-timeout"),
    (["--register-timeout", "1e9", "--", "true"], "register-timeout"),
    (["--stop-grace", "-1", "--", "true"], "stop-grace"),
    (["--port", "70000", "--", "true"], "port"),
    (["--fake-gpus", "-2", "--", "true"], "fake-gpus"),
    (["--cpus-per-node", "0", "--", "true"], "cpus-per-node"),
])
def test_bad_arguments_are_refused(argv, message):
    with pytest.raises(errors.InvalidArgumentError, match=message):
        slurm._check(slurm.build_parser().parse_args(argv))


def test_command_after_double_dash():
    args = slurm.build_parser().parse_args(["--fake-gpus", "2", "--", "python", "x.py", "--lr", "1"])
    assert slurm._check(args) == ["python", "x.py", "--lr", "1"]


def test_outside_an_allocation_exits_2(monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    assert slurm.main(["--", "true"]) == 2
    assert "not inside a Slurm allocation" in capsys.readouterr().err


def test_subcommand_is_registered():
    assert SUBCOMMANDS["slurm"][0] == "podium.cli.slurm:main"


def test_node_step_arguments_are_podium_node_flags():
    from podium.worker.agent.service import build_parser

    args = argparse.Namespace(scheduler="127.0.0.1:5000", log_dir="/tmp/x", cpus=8.0, fake_gpus=2, stop_grace=3.0)
    argv = slurmnode.agent_argv(args, {"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "9"})
    parsed = build_parser().parse_args(argv)  # an unknown flag would exit here
    assert (parsed.host, parsed.node_id, parsed.fake_gpus, parsed.log_dir) == ("127.0.0.1", "n1", 2, "/tmp/x/n1")
    assert "slurm_job_id=9" in parsed.label
    with pytest.raises(errors.InvalidArgumentError):
        slurmnode.split_address("nohost")


def test_default_cpu_slots():
    assert slurmnode.default_cpus(8, {"SLURM_CPUS_ON_NODE": "96"}) == 128.0
    assert slurmnode.default_cpus(0, {"SLURM_CPUS_ON_NODE": "96"}) == 96.0
    assert slurmnode.default_cpus(2, {"SLURM_CPUS_ON_NODE": "4"}) == 32.0


def test_job_gpus_come_from_the_allocation():
    assert slurmnode.job_gpus({"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_JOB_GPUS": "0,1"}) == ("2", "3")
    assert slurmnode.job_gpus({"SLURM_STEP_GPUS": "4,5"}) == ("4", "5")
    assert slurmnode.job_gpus({"SLURM_JOB_GPUS": "6"}) == ("6",)
    # No GPU named: a shared node's GPUs are other jobs'; only --all-gpus (or fakes) take all.
    assert slurmnode.job_gpus({}) == ()
    assert slurmnode.job_gpus({}, every_gpu=True) is None
    assert slurmnode.job_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, every_gpu=True) == ()
