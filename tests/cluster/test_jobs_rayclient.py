"""The real Ray 2.60 job client against a Podium cluster, changed in nothing but the token header:
``ray job submit --working-dir`` (logs tailed to the end), ``ray job list``, ``ray job status``,
``ray job logs --follow`` and ``ray job stop`` on a long job (which leaves no placement group,
worker or process behind), a verl-style driver that runs on after its submitting client was
killed, ``JobSubmissionClient`` from Python, Ray's own token auth, no token at all, and a job's
``pip``/``uv`` set (a requirements.txt the client reads, a wheel built here, a requirement that
cannot be installed).

Ray is in its own virtualenv (tools/install-ray-client.sh .venv-ray, or $PODIUM_RAY_CLIENT_VENV);
the cluster and the drivers use Podium's (their ``import ray`` is the stand-in).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.jobkit import start_up, stop_up, where_program, write_py_module, write_verl_layout, write_working_dir
from tests.support.waiting import REPO
from tests.support.wheels import tiny_wheel

VENV = Path(os.environ.get("PODIUM_RAY_CLIENT_VENV", REPO / ".venv-ray"))
RAY = VENV / "bin" / "ray"

pytestmark = [pytest.mark.cluster, pytest.mark.rayclient, pytest.mark.timeout(600),
              pytest.mark.skipif(not RAY.exists(), reason=f"the real Ray 2.60 job client is not installed: "
                                 f"no {RAY} (run tools/install-ray-client.sh {VENV})")]
GRACE = 3.0  # the scheduler's stop grace (podium.scheduler.jobs.STOP_GRACE_SECONDS)


def _ray_env(cluster, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PODIUM_", "RAY_", "VIRTUAL_ENV"))}
    env["PATH"] = f"{VENV / 'bin'}:{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def _ray(cluster, *args: str, headers: bool = True, env: dict | None = None,
         timeout: float = 240) -> tuple[int, str]:
    """(exit status, its output without colours) of ``ray job ARGS``."""
    flags = ["--address", cluster.http_url]
    if headers:
        flags += ["--headers", json.dumps({"Authorization": f"Bearer {cluster.token}"})]
    command = [str(RAY), "job", args[0], *flags, *args[1:]]
    done = subprocess.run(command, env=env or _ray_env(cluster), capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, _plain(done.stdout + done.stderr)


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@pytest.fixture
def cluster(tmp_path, token):
    up = start_up(tmp_path, token)
    yield up
    stop_up(up)


def test_ray_job_cli_submit_follow_status_list_stop(cluster, tmp_path):
    work = write_working_dir(tmp_path / "wd")
    # Submit and follow to the end, as verl's guide does (with the token header added).
    extra = write_py_module(tmp_path / "modules")
    runtime_env = {"env_vars": {"WHO": "ray-cli", "WITH_PY_MODULE": "1"}, "py_modules": [str(extra)]}
    code, out = _ray(cluster, "submit", "--submission-id", "first", "--working-dir", str(work),
                     "--runtime-env-json", json.dumps(runtime_env), "--", "python", "script.py")
    assert code == 0, out[-4000:]
    assert "py_modules: from py_modules" in out
    assert "RESULTS [1, 2]" in out and "hello ray-cli from the working dir" in out and "DONE" in out
    assert "Job 'first' succeeded" in out
    assert "Job 'first' succeeded" in _ray(cluster, "status", "first")[1]
    assert "submission_id='first'" in _ray(cluster, "list")[1]
    assert cluster.job("first")["driver_exit_code"] == 0

    # A long job: followed by `ray job logs --follow`, then stopped.
    code, out = _ray(cluster, "submit", "--no-wait", "--submission-id", "long", "--working-dir", str(work),
                     "--", "python", "script.py", "600")
    assert code == 0, out[-3000:]
    follower = subprocess.Popen([str(RAY), "job", "logs", "--address", cluster.http_url, "--headers",
                                 json.dumps({"Authorization": f"Bearer {cluster.token}"}), "--follow", "long"],
                                env=_ray_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while "tick 1" not in cluster.logs("long"):
            assert time.monotonic() < deadline, cluster.job("long")
            time.sleep(0.5)
        running = cluster.job("long")
        assert running["status"] == "RUNNING"
        workers = cluster.live_workers()
        assert len(workers) == 2 and len(cluster.placement_groups()) == 1
        code, out = _ray(cluster, "stop", "long")
        assert code == 0 and "was stopped" in out, out[-2000:]
        stopped_at = time.monotonic()
        followed, _ = follower.communicate(timeout=60)  # the tail ends with the job
    finally:
        if follower.poll() is None:
            follower.kill()
    assert "RESULTS [1, 2]" in followed and "tick 1" in followed
    assert cluster.job("long")["status"] == "STOPPED"
    pgid = int(running["driver_info"]["pid"])
    pids = [w["pid"] for w in workers]
    left = cluster.left_behind(pgid, pids)
    while any(left.values()) and time.monotonic() < stopped_at + GRACE + 5:
        time.sleep(0.2)
        left = cluster.left_behind(pgid, pids)
    assert not any(left.values()), left  # within the grace period plus 5 s
    # Stopping it again is a no-op that says so.
    code, out = _ray(cluster, "stop", "long")
    assert code == 0, out[-2000:]


def test_a_verl_style_driver_outlives_its_client_and_the_python_sdk(cluster, tmp_path):
    work = write_working_dir(tmp_path / "wd")
    client = subprocess.Popen([str(RAY), "job", "submit", "--address", cluster.http_url, "--headers",
                               json.dumps({"Authorization": f"Bearer {cluster.token}"}), "--submission-id",
                               "verl", "--working-dir", str(work), "--", "python", "verl_style.py"],
                              env=_ray_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while "TASKRUNNER STARTED" not in cluster.logs("verl"):
        assert client.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    client.send_signal(signal.SIGKILL)  # the submitting terminal goes away mid-job
    client.wait(timeout=30)
    done = cluster.wait_job("verl", {"SUCCEEDED", "FAILED", "STOPPED"})
    assert done["status"] == "SUCCEEDED", done["message"]
    logs = cluster.logs("verl")
    assert "TASKRUNNER DONE [[0, 1], [10, 11], [20, 21], [30, 31], [40, 41], [50, 51]]" in logs

    sdk = textwrap.dedent(f'''
        import json, time
        from ray.job_submission import JobSubmissionClient, JobStatus
        client = JobSubmissionClient({cluster.http_url!r}, headers={{"Authorization": "Bearer {cluster.token}"}})
        job = client.submit_job(entrypoint="python -c 'import ray; print(ray.__podium__)'",
                                runtime_env={{"working_dir": {str(work)!r}}}, metadata={{"by": "sdk"}})
        while not client.get_job_status(job).is_terminal():
            time.sleep(0.2)
        info = client.get_job_info(job)
        print(json.dumps({{"status": str(info.status), "logs": client.get_job_logs(job),
                           "metadata": info.metadata, "listed": [j.submission_id for j in client.list_jobs()],
                           "stop_ended": client.stop_job(job), "deleted": client.delete_job(job),
                           "after": [j.submission_id for j in client.list_jobs()], "job": job}}))
    ''')
    run = subprocess.run([str(VENV / "bin" / "python"), "-c", sdk], env=_ray_env(cluster), capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["status"] == "SUCCEEDED" and result["logs"] == "True\n" and result["metadata"] == {"by": "sdk"}
    assert result["job"] in result["listed"] and "verl" in result["listed"]
    assert result["stop_ended"] is False and result["deleted"] is True and result["job"] not in result["after"]


def test_ray_token_auth_and_no_token(cluster):
    # Ray 2.60's own token authentication sends the same bearer token, no --headers needed.
    env = _ray_env(cluster, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=cluster.token)
    code, out = _ray(cluster, "list", headers=False, env=env)
    assert code == 0, out[-3000:]
    # Without it: 401 (which Ray's client words "Authentication required"), nothing submitted.
    for args in (("list",), ("status", "x"), ("submit", "--no-wait", "--", "touch", "/tmp/podium-never")):
        code, out = _ray(cluster, *args, headers=False)
        assert code != 0 and "Authentication required" in out, (args, out[-2000:])
    assert cluster.get("/api/jobs/")[1] == []


def test_verls_multinode_command_with_the_token_header(cluster, tmp_path):
    """The README's command: verl's guide's `ray job submit --runtime-env=...runtime_env.yaml
    --no-wait -- python3 -m ...main_ppo ...`, run from the repository, token in RAY_JOB_HEADERS."""
    repo = write_verl_layout(tmp_path / "verl")
    env = _ray_env(cluster, RAY_JOB_HEADERS=json.dumps({"Authorization": f"Bearer {cluster.token}"}))
    done = subprocess.run([str(RAY), "job", "submit", f"--address={cluster.http_url}",
                           "--runtime-env=trainer/runtime_env.yaml", "--no-wait", "--submission-id", "ppo", "--",
                           "python3", "-m", "trainer.main_ppo", "trainer.nnodes=2", "trainer.n_gpus_per_node=1"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, _plain(done.stdout + done.stderr)[-3000:]
    job = cluster.wait_job("ppo", {"SUCCEEDED", "FAILED", "STOPPED"})
    assert job["status"] == "SUCCEEDED", job["message"]
    assert job["runtime_env"]["env_vars"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "MAIN_PPO ['trainer.nnodes=2', 'trainer.n_gpus_per_node=1'] 1 ['CPU', 'GPU', 'memory', 'node:" in cluster.logs("ppo")


#: A driver that shows where it runs and where its actor runs.
PIP_PROGRAM = where_program("podium_raypip")


def test_a_jobs_pip_and_uv_sets_from_rays_client(cluster, tmp_path):
    wheel = tiny_wheel(tmp_path / "wheels", "podium_raypip", "1.0", "from-the-wheel")
    work = tmp_path / "wd"
    work.mkdir()
    (work / "script.py").write_text(PIP_PROGRAM)
    (work / "requirements.txt").write_text(f"{wheel}\n")
    # `ray job submit` reads the requirements file here and sends its lines (RuntimeEnv.to_dict).
    code, out = _ray(cluster, "submit", "--submission-id", "pip", "--working-dir", str(work), "--runtime-env-json",
                     json.dumps({"pip": str(work / "requirements.txt")}), "--", "python", "script.py", timeout=400)
    assert code == 0 and "Job 'pip' succeeded" in out, out[-4000:]
    driver = next(line.split() for line in out.splitlines() if line.startswith("DRIVER"))
    actor = next(line.split() for line in out.splitlines() if line.startswith("ACTOR"))
    assert driver[1] == "from-the-wheel" and "runtime_envs/pip/" in driver[2] and driver[3] == f"{driver[2]}/bin/python"
    assert actor[1] == "from-the-wheel" and Path(actor[2]).name == Path(driver[2]).name
    assert cluster.job("pip")["runtime_env"]["pip"] == {"packages": [str(wheel)], "pip_check": False}

    missing = tmp_path / "nowhere" / "podium_missing-1.0-py3-none-any.whl"
    sdk = textwrap.dedent(f'''
        import json, time
        from ray.job_submission import JobSubmissionClient
        client = JobSubmissionClient({cluster.http_url!r}, headers={{"Authorization": "Bearer {cluster.token}"}})
        out = {{}}
        for name, env in (("uv", {{"uv": [{str(wheel)!r}]}}), ("broken", {{"pip": [{str(missing)!r}]}})):
            job = client.submit_job(entrypoint="python script.py", submission_id=name,
                                    runtime_env={{**env, "working_dir": {str(work)!r}}})
            while not client.get_job_status(job).is_terminal():
                time.sleep(0.2)
            info = client.get_job_info(job)
            out[name] = {{"status": str(info.status), "error_type": info.error_type, "message": info.message,
                         "logs": client.get_job_logs(job)}}
        print(json.dumps(out))
    ''')
    run = subprocess.run([str(VENV / "bin" / "python"), "-c", sdk], env=_ray_env(cluster), capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    uv, broken = result["uv"], result["broken"]
    assert uv["status"] == "SUCCEEDED", uv
    assert "DRIVER from-the-wheel" in uv["logs"] and "ACTOR from-the-wheel" in uv["logs"]
    assert (broken["status"], broken["error_type"]) == ("FAILED", "RUNTIME_ENV_SETUP_FAILURE"), broken
    assert "pip install failed" in broken["message"] and "podium_missing" in broken["message"]
    assert "pip install failed" in broken["logs"]
