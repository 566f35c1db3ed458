"""runtime_env ``pip`` under ``podium run`` with plain ``import ray``: ``ray.init``'s set (a
requirements.txt) for every actor, one virtualenv shared by two actors and a task asking for one
other set at once, a child inheriting its parent's, a failing requirement as a WorkerDiedError
with pip's lines, and ``pip`` with ``py_executable`` refused. Wheels are built here: no index."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.wheels import tiny_wheel

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

PROGRAM = Path(__file__).with_name("ray_pip_env_program.py")


def test_pip_env_under_podium_run(tmp_path):
    first = tiny_wheel(tmp_path / "w1", "podium_pipdemo", "1.0", "one")
    second = tiny_wheel(tmp_path / "w2", "podium_pipdemo", "2.0", "two")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"# the job's set\n{first}\n")
    missing = tmp_path / "nowhere" / "podium_missing-1.0-py3-none-any.whl"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "8", "--",
                          sys.executable, str(PROGRAM), str(requirements), str(second), str(missing)],
                         env=env, capture_output=True, text=True, timeout=360)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "PIP ENV OK" in run.stdout, out[-6000:]
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert lines["driver"] == "without it"
    value, job_prefix = lines["job default"].split()
    assert value == "one" and "runtime_envs/pip/" in job_prefix
    pair = ast.literal_eval(lines["pair"])
    assert len(set(pair)) == 1, pair  # the same set: one virtualenv
    value, other_prefix = pair[0].split()
    assert value == "two" and other_prefix != job_prefix and "runtime_envs/pip/" in other_prefix
    assert lines["task"] == pair[0] and lines["child"] == pair[0]
    made = ast.literal_eval(lines["cache"])  # the node's cache, listed while the job ran: nothing half made
    assert made == sorted({Path(job_prefix).name, Path(other_prefix).name}), made
    assert lines["missing"].startswith("WorkerDiedError") and "pip install failed" in lines["missing"]
    assert "podium_missing" in lines["missing"]
    assert "'pip' and 'py_executable'" in lines["both"]
