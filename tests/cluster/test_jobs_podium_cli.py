"""``podium job`` (no Ray installed) against a ``podium up`` cluster: the flow of
test_jobs_rayclient.py (submit with a working dir and follow, list, status, logs --follow, stop
a long job leaving nothing behind, stop again, delete, no token), and a scheduler killed with
SIGKILL: restarted on its state file, it marks the job it was running FAILED with the reason
and kills what was left of its driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.jobkit import (UpCluster, podium, start_up, stop_up, write_py_module, write_verl_layout,
                                  write_working_dir)
from tests.support.proctable import alive, members_of_groups

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
GRACE = 3.0  # the scheduler's stop grace (podium.scheduler.jobs.STOP_GRACE_SECONDS)


@pytest.fixture
def cluster(tmp_path, token):
    up = start_up(tmp_path, token)
    yield up
    stop_up(up)


def test_podium_job_flow(cluster, tmp_path):
    work = write_working_dir(tmp_path / "wd")
    env, url = cluster.env, cluster.http_url
    # verl's command shape, its runtime env file as it is (YAML, working_dir ./, excludes).
    repo = write_verl_layout(tmp_path / "verl")
    ppo = podium("job", "submit", "--address", url, "--runtime-env", "trainer/runtime_env.yaml", "--", "python3",
                 "-m", "trainer.main_ppo", "trainer.nnodes=2", env=env, cwd=repo, timeout=300)
    assert ppo.returncode == 0, ppo.stdout[-3000:] + ppo.stderr[-3000:]
    assert "MAIN_PPO ['trainer.nnodes=2'] 1 ['CPU', 'GPU', 'memory', 'node:" in ppo.stdout
    extra = write_py_module(tmp_path / "modules")
    runtime_env = {"env_vars": {"WHO": "podium-cli", "WITH_PY_MODULE": "1"}, "py_modules": [str(extra)]}
    done = podium("job", "submit", "--address", url, "--submission-id", "first", "--working-dir", str(work),
                  "--runtime-env-json", json.dumps(runtime_env), "--", "python", "script.py", env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "py_modules: from py_modules" in done.stdout
    assert "RESULTS [1, 2]" in done.stdout and "hello podium-cli from the working dir" in done.stdout
    assert "Job 'first' succeeded" in done.stdout
    # The local cluster is found through --dir too (no address), the token with it.
    by_dir = podium("job", "status", "first", "--dir", str(cluster.dir), env=env)
    assert "Status for job 'first': SUCCEEDED" in by_dir.stdout, by_dir.stderr
    listed = podium("job", "list", "--address", url, env=env)
    assert "first\tSUCCEEDED\tpython script.py" in listed.stdout
    logs = podium("job", "logs", "first", "--address", url, env=env)
    assert "DONE" in logs.stdout

    # A driver that ignores SIGTERM: the SIGKILL after the grace ends it, and its sessions are
    # closed by the scheduler then (not by the driver, nor 30 s later by their lease).
    submitted = podium("job", "submit", "--address", url, "--no-wait", "--submission-id", "long",
                       "--working-dir", str(work), "--entrypoint-num-cpus", "1", "--runtime-env-json",
                       json.dumps({"env_vars": {"IGNORE_SIGTERM": "1"}}), "--", "python", "script.py", "600",
                       env=env)
    assert submitted.returncode == 0 and "submitted successfully" in submitted.stdout, submitted.stderr
    follower = subprocess.Popen([sys.executable, "-m", "podium.cli", "job", "logs", "--follow", "long",
                                 "--address", url], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while "tick 1" not in cluster.logs("long"):
            assert time.monotonic() < deadline, cluster.job("long")
            time.sleep(0.5)
        running = cluster.job("long")
        workers = cluster.live_workers()
        assert running["entrypoint_num_cpus"] == 1 and len(workers) == 2
        stop = podium("job", "stop", "long", "--address", url, env=env)
        stopped_at = time.monotonic()
        assert stop.returncode == 0 and "Job 'long' stopped" in stop.stdout, stop.stdout + stop.stderr
        followed, _ = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert "RESULTS [1, 2]" in followed and "tick 1" in followed
    pgid, pids = int(running["driver_info"]["pid"]), [w["pid"] for w in workers]
    left = cluster.left_behind(pgid, pids)
    while any(left.values()) and time.monotonic() < stopped_at + GRACE + 5:
        time.sleep(0.2)
        left = cluster.left_behind(pgid, pids)
    assert not any(left.values()), left
    again = podium("job", "stop", "long", "--address", url, env=env)
    assert again.returncode == 0 and "had already ended (STOPPED): nothing to stop" in again.stdout
    deleted = podium("job", "delete", "long", "--address", url, env=env)
    assert deleted.returncode == 0, deleted.stderr
    for command in (("status", "long"), ("logs", "long", "--follow")):
        gone = podium("job", *command, "--address", url, env=env)
        assert gone.returncode == 1 and "404" in gone.stderr and "does not exist" in gone.stderr, gone.stderr
    wrong = podium("job", "list", "--address", url, env=dict(env, PODIUM_TOKEN="wrong"))
    assert wrong.returncode == 1 and "401" in wrong.stderr
    bad = podium("job", "submit", "--address", url, "--runtime-env-json", '{"conda": "env"}', "--",
                 "python", "x.py", env=env)
    assert bad.returncode == 1 and "400" in bad.stderr and "conda is not supported" in bad.stderr

    # `podium down` while a job runs: the scheduler stops it first, nothing of it is left.
    podium("job", "submit", "--address", url, "--no-wait", "--submission-id", "at-down", "--",
           "sleep", "600", env=env)
    driver = int(cluster.wait_job("at-down", {"RUNNING"})["driver_info"]["pid"])
    stop_up(cluster)
    deadline = time.monotonic() + 5
    while members_of_groups({driver}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert members_of_groups({driver}) == []


def test_a_job_whose_supervisor_died_is_failed_after_a_restart(scheduler_process, tmp_path, token):
    state = tmp_path / "state.db"
    scheduler = scheduler_process(state)
    env = dict(os.environ, PODIUM_TOKEN=token)
    env.pop("RAY_ADDRESS", None)
    submitted = podium("job", "submit", "--address", scheduler.http_url, "--no-wait", "--submission-id", "lost",
                       "--", "echo", "started;", "sleep", "600", env=env)
    assert submitted.returncode == 0, submitted.stderr
    before = UpCluster(dir=tmp_path, http_url=scheduler.http_url, token=token, env=env)
    driver = int(before.wait_job("lost", {"RUNNING"}, timeout=60)["driver_info"]["pid"])
    deadline = time.monotonic() + 60
    while "started" not in before.logs("lost"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    scheduler.kill(signal.SIGKILL)
    assert alive(driver)  # the supervisor died; its driver did not
    restarted = scheduler_process(state)
    status = podium("job", "status", "lost", "--address", restarted.http_url, env=env)
    assert "FAILED" in status.stdout and "Job supervisor died" in status.stdout, status.stdout + status.stderr
    assert f"its driver (pid {driver}) was still running and was killed" in status.stdout
    after = UpCluster(dir=tmp_path, http_url=restarted.http_url, token=token, env=env)
    assert after.job("lost")["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED"
    assert "started" in after.logs("lost")
    deadline = time.monotonic() + 10
    while alive(driver):
        assert time.monotonic() < deadline, f"driver {driver} still alive"
        time.sleep(0.1)
