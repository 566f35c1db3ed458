"""Actor restarts (``max_restarts``, ``max_task_retries``) and task retries (``max_retries``,
``retry_exceptions``): a plain ``import ray`` program (restart_program.py) under ``podium run``,
its actors killed with SIGKILL from outside; and an actor whose node is lost, on two loopback
nodes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.clusters import TWO_NODES, two_node_processes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

HERE = Path(__file__).parent

EXPECTED = {
    "first incr": "11",
    "through borrower": "12",
    # Twice the actor comes back: a call in flight fails (max_task_retries=0, as Ray), the
    # state is the constructor's again, the name and the handles (the owner's, one looked up
    # by name, one passed into another actor) reach the new process.
    **{f"{key} {n}": value for n in (1, 2) for key, value in (
        ("in flight", "ActorUnavailableError"), ("state after restart", "11"), ("new process", "True True"),
        ("by name", "12"), ("borrower", "13"))},
    "restarts 1": "[1]",
    "restarts 2": "[2]",
    # The third death is final: ActorDiedError naming the count, for every caller.
    "in flight 3": "WorkerDiedError False True",
    "after last death": "WorkerDiedError False True",
    "borrower after last death": "True",
    "live counter workers": "0",
    # max_restarts=-1: 20 deaths, 21 processes, each old one gone, one live worker.
    "forever distinct pids": "21",
    "forever old processes gone": "True",
    "forever live workers": "1 20",
    "forever CPUs free as before": "True",
    "max_task_retries": "done after 1 call(s) on this incarnation",
    "task default retries": "ran again",
    "task max_retries=0": "WorkerDiedError",
    "retry_exceptions": "succeeded on attempt 3",
    "other exception": "True 1",
    "retries used up": "2",
}


def test_restarts_and_retries_under_podium_run(tmp_path):
    done = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "16", "--",
                           sys.executable, "restart_program.py", str(tmp_path)],
                          cwd=HERE, env=dict(os.environ), capture_output=True, text=True, timeout=280)
    assert done.returncode == 0 and "PROGRAM OK" in done.stdout, (done.stdout + done.stderr)[-5000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert {k: lines.get(k) for k in EXPECTED} == EXPECTED


def test_an_actor_whose_node_is_lost_comes_back_on_another_node(tmp_path):
    # The first node's agent and the actor's process are SIGKILLed; once the scheduler
    # declares that node dead (its 15 s lease), the owner places the actor on the other node.
    with two_node_processes(tmp_path, gpus_per_node=0, cpus=4) as cluster:
        victim = TWO_NODES[0]
        env = dict(os.environ, PODIUM_TOKEN=cluster.token, VICTIM_HOST=victim,
                   VICTIM_AGENT_PID=str(cluster.agents[victim].pid))
        done = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--address", cluster.address, "--",
                               sys.executable, "restart_node_program.py"],
                              cwd=HERE, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "PROGRAM OK" in done.stdout, (done.stdout + done.stderr)[-5000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert (lines["before"], lines["after"], lines["by name"]) == ("True", "t True", "True"), lines


def test_a_restartable_actor_that_stops_answering_is_restarted(tmp_path):
    env = dict(os.environ, PODIUM_LIVENESS_SECONDS="2")
    done = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "4", "--",
                           sys.executable, "restart_hung_program.py"],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0 and "PROGRAM OK" in done.stdout, (done.stdout + done.stderr)[-5000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert (lines["pending call"], lines["restarted"], lines["hung process stopped"]) == (
        "UnresponsiveError", "True", "True"), lines
