"""`podium slurm` under a real Slurm: sbatch the shipped script over two nodes, then scancel one.

The cluster is munged, slurmctld and two slurmd (nodes n1 and n2) started by this test
(tests/support/slurmkit.py) on 127.0.0.1. The job is deploy/slurm/podium.sbatch running
slurm_controller.py on both nodes: each node fakes 4 GPUs and the job is given
CUDA_VISIBLE_DEVICES=1,3, as Slurm's gres plugin would, so on each node the two workers
must get GPU 1 and GPU 3. Skipped, naming what is missing, without root or the
slurm-wlm/munge packages. Adds about 90 s (two WorkerGroups of four on this machine).
"""

from __future__ import annotations

import re
import stat
import sys
import time
from pathlib import Path

import pytest

from tests.support import slurmkit

pytestmark = [pytest.mark.slurm, pytest.mark.cluster, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "podium.sbatch"
CONTROLLER = Path(__file__).with_name("slurm_controller.py")
JOB_TIMEOUT = 240.0
GONE_TIMEOUT = 90.0


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurmkit.missing()
    if why:
        pytest.skip(why)
    cluster = slurmkit.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _submit(slurm, tmp_path: Path, *controller_args: str) -> tuple[str, Path, Path]:
    job_dir, out = tmp_path / "job", tmp_path / "job.out"
    # Both "nodes" are this machine: the scheduler's address is 127.0.0.1, which the
    # launcher refuses to guess for a multi-node job (a real cluster needs the node's IP).
    env = {"PODIUM": f"{sys.executable} -m podium.cli", "CUDA_VISIBLE_DEVICES": "1,3",
           "PODIUM_TEST_PROCESS_ON_NODES": "2,2",
           "PODIUM_SLURM_ARGS": f"--job-dir {job_dir} --fake-gpus 4 --register-timeout 120 "
                                f"--scheduler-host 127.0.0.1"}
    reply = slurm.run(["sbatch", "--parsable", f"--nodes={len(slurmkit.NODES)}", f"--output={out}",
                       "--chdir", str(tmp_path), str(SBATCH), sys.executable, str(CONTROLLER),
                       *controller_args], env=env)
    return reply.stdout.strip().split(";")[0], job_dir, out


def _until(check, what: str, timeout: float, explain) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{explain()}")
        time.sleep(0.25)


def _explain(slurm, out: Path, job_dir: Path):
    def explain() -> str:
        parts = [f"--- job output\n{out.read_text(errors='replace') if out.exists() else '(none)'}"]
        for log in sorted((job_dir / "logs").glob("*.log")) if job_dir.exists() else []:
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts) + "\n" + slurm.logs()
    return explain


def test_sbatch_runs_a_workergroup_and_leaves_nothing(slurm, tmp_path):
    job, job_dir, out = _submit(slurm, tmp_path, "0", "3")  # the controller exits with 3
    explain = _explain(slurm, out, job_dir)
    _until(lambda: slurm.job_state(job) == "", f"job {job} to finish", JOB_TIMEOUT, explain)
    text = out.read_text()
    assert "controller: workergroup ok" in text, explain()
    ranks = re.findall(r"controller: rank (\d) pid \d+ gpus (\S+) job (\d+) node (\S+)", text)
    # Four workers, two on each node, each given one of the job's GPUs there (1 and 3 of 4).
    assert sorted((node, gpu, j) for _, gpu, j, node in ranks) == [
        ("n1", "1", job), ("n1", "3", job), ("n2", "1", job), ("n2", "3", job)], explain()
    # The controller's status is the launcher's, so the job's (after everything was stopped).
    assert "exited with code 3" in text, explain()
    info = slurm.run(["scontrol", "show", "job", job], check=False).stdout
    assert "ExitCode=3:0" in info, info
    _until(lambda: not slurmkit.job_processes(slurm.name, job), "the job's processes to end", GONE_TIMEOUT,
           lambda: "\n".join(slurmkit.job_processes(slurm.name, job)) + explain())
    assert not (job_dir / "token").exists(), "the per-job token outlived the job"
    agents = (job_dir / "logs" / "agents.log").read_text()
    for node in slurmkit.NODES:  # every node offered only the job's GPUs, and was stopped, not killed
        assert f"podium slurm node: {node} serving on 127.0.0.1:" in agents and "with 2 GPUs" in agents, agents
        assert f"node agent {node}: shutting down" in agents and f"node agent {node}: stopped" in agents, agents


def test_scancel_mid_run_leaves_no_podium_process(slurm, tmp_path):
    job, job_dir, out = _submit(slurm, tmp_path, "600")
    explain = _explain(slurm, out, job_dir)
    _until(lambda: out.exists() and "controller: sleeping" in out.read_text(), "the controller to sleep",
           JOB_TIMEOUT, explain)
    token = job_dir / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    running = slurmkit.job_processes(slurm.name, job)
    # launcher, scheduler, srun, two node agents and four workers (at least) run in the job.
    assert sum("podium" in line for line in running) >= 8, running
    agents = [line for line in running if "-m podium.cli.slurmnode" in line and "srun" not in line]
    assert len(agents) == len(slurmkit.NODES), running
    slurm.run(["scancel", job])
    _until(lambda: slurm.job_state(job) == "", f"job {job} to leave the queue", GONE_TIMEOUT, explain)
    _until(lambda: not slurmkit.job_processes(slurm.name, job), "no process of the job left", GONE_TIMEOUT,
           lambda: "\n".join(slurmkit.job_processes(slurm.name, job)) + explain())
    text = out.read_text()
    # scancel signals every process of the job at once: the launcher sees its SIGTERM, or
    # (a rare race) first sees the controller end from its own SIGTERM; 143 either way.
    assert "got SIGTERM: stopping" in text or "exited with code 143" in text, explain()
    assert not token.exists(), "the per-job token outlived the cancelled job"
    agents = (job_dir / "logs" / "agents.log").read_text()
    assert agents.count("WORKER_EXITED") == 4, agents
