"""runtime_env package URIs on a real cluster (a scheduler and two node agents as processes),
with plain ``import ray`` under ``podium run --address``: packages uploaded as ``ray job submit``
uploads them, named as ``working_dir`` per actor and ``py_modules`` in ``ray.init``, fetched by
each node that hosts a worker from the scheduler with the cluster token, unpacked once per node;
a package never uploaded is the worker's error, an ``s3://`` URI is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from podium.cli.job import zip_folder
from tests.support.clusters import TWO_NODES, two_node_processes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PROGRAM = Path(__file__).with_name("ray_packages_program.py")


def _upload(http_port: int, token: str, folder: Path, parent: bool = False) -> str:
    name, data = zip_folder(folder, parent=parent)
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/api/packages/gcs/{name}", data=data,
                                     method="PUT", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
    return f"gcs://{name}"


def test_uploaded_packages_as_working_dir_and_py_modules(tmp_path):
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "wd_module.py").write_text("VALUE = 40\n")
    (tmp_path / "mods" / "pkg_module").mkdir(parents=True)
    (tmp_path / "mods" / "pkg_module" / "__init__.py").write_text("VALUE = 2\n")
    with two_node_processes(tmp_path, gpus_per_node=0, cpus=4) as cluster:
        working_dir = _upload(cluster.http_port, cluster.token, tmp_path / "wd")
        module = _upload(cluster.http_port, cluster.token, tmp_path / "mods" / "pkg_module", parent=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS", "PODIUM_TOKEN_FILE")}
        env["PODIUM_TOKEN"] = cluster.token
        run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--address", cluster.address, "--",
                              sys.executable, str(PROGRAM), working_dir, module,
                              "gcs://_ray_pkg_ffffffffffffffff.zip"],
                             env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "PACKAGES OK" in run.stdout, out[-6000:]
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert lines["task"] == "2"
    key = working_dir.removeprefix("gcs://").removesuffix(".zip")
    placed = eval(lines["actors"])  # noqa: S307 - our own program's printed list
    assert {p.split()[0] for p in placed} == {key} and {p.split()[1] for p in placed} == {"42"}
    # Each node that hosted one fetched it once into its own cache (a node's id ends in its address).
    hosts = {host for host in TWO_NODES for p in placed if p.split()[2].endswith(host)}
    assert hosts, placed
    for host in hosts:
        cache = tmp_path / host / "runtime_envs" / "packages"
        assert key in [p.name for p in cache.iterdir() if p.is_dir()]
    assert lines["missing"].startswith("WorkerDiedError") and "does not exist on this cluster" in lines["missing"]
    assert "gcs://_ray_pkg_<hash>.zip" in lines["s3"] and "not s3://" in lines["s3"]
