"""runtime_env under ``podium run`` with plain ``import ray``: py_executable starts the worker
with another interpreter command (per actor, per task, inherited by what an actor creates,
beside a plain actor in one placement group), a command that does not start is a
WorkerDiedError with its stderr, an interpreter without Podium is named, and working_dir /
py_modules import in the worker."""

from __future__ import annotations

import ast
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

PROGRAM = Path(__file__).with_name("ray_runtime_env_program.py")


def _venv(path: Path, with_podium: bool) -> Path:
    """A second virtualenv (its own sys.executable); ``with_podium``: it sees this one's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    if with_podium:
        own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                             capture_output=True, text=True, check=True).stdout.strip()
        lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages())
        Path(own, "podium_parent.pth").write_text(lines)
    return python


def test_runtime_env_under_podium_run(tmp_path):
    alt = _venv(tmp_path / "alt", with_podium=True)
    bare = _venv(tmp_path / "bare", with_podium=False)
    wrapped = f"env PODIUM_TEST_WRAPPED=1 {alt}"
    workdir = tmp_path / "wd"
    workdir.mkdir()
    (workdir / "wd_module.py").write_text("VALUE = 40\n")
    pkg = tmp_path / "mods" / "extra_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 2\n")
    (tmp_path / "mods" / "sibling.py").write_text("")  # beside the module: not importable
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS")}
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "8", "--",
                          sys.executable, str(PROGRAM), wrapped, str(bare), str(workdir), str(pkg)],
                         env=env, capture_output=True, text=True, timeout=360)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "RUNTIME ENV OK" in run.stdout, out[-6000:]
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    wrapped_where = ast.literal_eval(lines["wrapped"])
    plain_where = ast.literal_eval(lines["plain"])
    assert wrapped_where["exe"] == str(alt) and wrapped_where["flag"] == "1"
    assert plain_where["exe"] != str(alt) and plain_where["flag"] == ""
    assert lines["child"] == str(alt)
    assert lines["task"] == str(alt)
    assert lines["dirs"] == f"{workdir} 42"
    assert lines["missing"].startswith("WorkerDiedError") and "/nonexistent/bin/python3" in lines["missing"]
    assert lines["broken"].startswith("WorkerDiedError") and "interpreter-broken" in lines["broken"]
    assert lines["no podium"].startswith("WorkerDiedError")
    assert f"does not import in the interpreter {bare}" in lines["no podium"]
