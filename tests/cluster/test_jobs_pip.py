"""A submitted job's runtime_env ``pip`` with ``podium job submit`` against a ``podium up``
cluster, the wheels built here (no index): a requirements.txt read by the CLI; the driver run by
the virtualenv's python (its entrypoint's ``python`` is the virtualenv's) on the scheduler's
machine and, when it asks for a GPU, on the node that holds one through its agent, each from that
machine's cache; the actors it creates in the same set; and a requirement that cannot be
installed failing the job as ``RUNTIME_ENV_SETUP_FAILURE`` with pip's lines in its message and
logs, wherever its driver runs; and a job stopped while its set installs ending STOPPED with
nothing of its driver (the launcher, pip) left."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from tests.support.jobkit import podium, start_up, stop_up, where_program
from tests.support.proctable import members_of_groups
from tests.support.wheels import tiny_wheel

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

PROGRAM = where_program("podium_jobpip")


@pytest.fixture
def cluster(tmp_path, token):
    up = start_up(tmp_path, token)
    yield up
    stop_up(up)


def _lines(out: str) -> dict[str, list[str]]:
    return {words[0]: words[1:] for words in map(str.split, out.splitlines()) if words[:1] in (["DRIVER"], ["ACTOR"])}


def test_a_jobs_pip_set_runs_its_driver_and_actors(cluster, tmp_path):
    wheel = tiny_wheel(tmp_path / "wheels", "podium_jobpip", "1.0", "from-the-wheel")
    work = tmp_path / "wd"
    work.mkdir()
    (work / "script.py").write_text(PROGRAM)
    (work / "requirements.txt").write_text(f"# the job's set\n{wheel}\n")
    env, url = cluster.env, cluster.http_url
    prefixes = {}
    for job_id, extra in (("here", []), ("on-a-node", ["--entrypoint-num-gpus", "1"])):
        done = podium("job", "submit", "--address", url, "--submission-id", job_id, "--working-dir", str(work),
                      *extra, "--runtime-env-json", json.dumps({"pip": "requirements.txt"}), "--",
                      "python", "script.py", env=env, cwd=work, timeout=400)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
        lines = _lines(done.stdout)
        value, prefix, python = lines["DRIVER"]
        assert value == "from-the-wheel" and "runtime_envs/pip/" in prefix, lines
        assert python == f"{prefix}/bin/python"  # activated: the entrypoint's `python` is the virtualenv's
        actor_value, actor_prefix = lines["ACTOR"]
        assert actor_value == "from-the-wheel" and Path(actor_prefix).name == Path(prefix).name  # the same set
        job = cluster.job(job_id)
        assert job["status"] == "SUCCEEDED" and job["runtime_env"]["pip"] == [str(wheel)], job  # the file's lines
        prefixes[job_id] = (prefix, job["driver_info"]["node_ip_address"])
    (here, _), (placed, node) = prefixes["here"], prefixes["on-a-node"]
    assert str(cluster.dir) in here and node and str(cluster.dir) in placed and placed != here  # two caches

    missing = tmp_path / "nowhere" / "podium_missing-1.0-py3-none-any.whl"
    for job_id, extra in (("broken", []), ("broken-on-a-node", ["--entrypoint-num-gpus", "1"])):
        failed = podium("job", "submit", "--address", url, "--submission-id", job_id, *extra,
                        "--runtime-env-json", json.dumps({"pip": [str(missing)]}), "--", "python", "-c", "print(1)",
                        env=env, timeout=400)
        assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
        job = cluster.job(job_id)
        assert (job["status"], job["error_type"]) == ("FAILED", "RUNTIME_ENV_SETUP_FAILURE"), job
        assert "pip install failed" in job["message"] and "podium_missing" in job["message"], job["message"]
        assert "pip install failed" in cluster.logs(job_id)

    # A stop while the set installs: pip waits on a server that accepts and never answers.
    with socket.socket() as stall:
        stall.bind(("127.0.0.1", 0))
        stall.listen(8)
        stall.settimeout(180)
        stalled = f"podium_stalled @ http://127.0.0.1:{stall.getsockname()[1]}/podium_stalled-1.0-py3-none-any.whl"
        submitted = podium("job", "submit", "--address", url, "--no-wait", "--submission-id", "stalled",
                           "--runtime-env-json", json.dumps({"pip": [stalled]}), "--", "python", "-c", "print(1)",
                           env=env)
        assert submitted.returncode == 0, submitted.stderr
        connection, _ = stall.accept()  # pip is fetching: the install is under way
        with connection:
            pgid = int(cluster.wait_job("stalled", {"RUNNING"})["driver_info"]["pid"])
            assert members_of_groups({pgid})
            stop = podium("job", "stop", "stalled", "--address", url, env=env)
            assert stop.returncode == 0 and "Job 'stalled' stopped" in stop.stdout, stop.stdout + stop.stderr
            assert cluster.wait_job("stalled", {"STOPPED", "FAILED", "SUCCEEDED"})["status"] == "STOPPED"
            deadline = time.monotonic() + 30
            while members_of_groups({pgid}):
                assert time.monotonic() < deadline, members_of_groups({pgid})
                time.sleep(0.2)
