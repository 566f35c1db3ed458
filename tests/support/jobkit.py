"""Submitted-job tests: a ``podium up`` cluster, the drivers they submit, and what "nothing left
behind" means (no placement group, no live worker, no process of the driver's group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.support.proctable import alive, members_of_groups

#: A driver as the issue asks: ray.init(), a placement group, actors in it, a module from its
#: working dir; ``python script.py N`` then ticks N seconds. IGNORE_SIGTERM=1: it ignores
#: SIGTERM; WITH_PY_MODULE=1: it imports ``extra`` (write_py_module's) too.
SCRIPT = textwrap.dedent('''
    import os, signal, sys, time
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    import helper

    if os.environ.get("IGNORE_SIGTERM"):  # only the SIGKILL after the grace ends this driver
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("WITH_PY_MODULE"):
        import extra  # shipped in py_modules
        print("py_modules:", extra.VALUE, flush=True)
    ray.init()
    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(pg.ready())

    @ray.remote(num_cpus=1)
    class Counter:
        def __init__(self):
            self.n = 0
        def add(self, k):
            self.n += k
            return self.n

    actors = [Counter.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(2)]
    print("RESULTS", ray.get([a.add.remote(i + 1) for i, a in enumerate(actors)]), flush=True)
    print(helper.greet(os.environ.get("WHO", "nobody")), flush=True)
    for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 0):
        print("tick", i, flush=True)
        time.sleep(1)
    print("DONE", flush=True)
''')
HELPER = 'def greet(name):\n    return f"hello {name} from the working dir"\n'

#: A verl-style driver: main() starts a TaskRunner actor, which builds the worker groups (a
#: placement group of GPU bundles and one actor per bundle) and drives them; the driver waits.
VERL_STYLE = textwrap.dedent('''
    import time
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    class RolloutWorker:
        def __init__(self, rank):
            self.rank = rank
        def generate(self, step):
            return step * 10 + self.rank

    @ray.remote(num_cpus=1)
    class TaskRunner:
        def run(self, steps):
            pg = placement_group([{"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}], strategy="SPREAD")
            ray.get(pg.ready())
            group = [RolloutWorker.options(num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=r)).remote(r) for r in range(2)]
            out = []
            for step in range(steps):
                out.append(ray.get([w.generate.remote(step) for w in group]))
                time.sleep(1)
            return out

    if __name__ == "__main__":
        ray.init()
        print("TASKRUNNER STARTED", flush=True)
        runner = TaskRunner.remote()  # held, as verl's main_ppo holds it
        print("TASKRUNNER DONE", ray.get(runner.run.remote(6)), flush=True)
''')


def write_working_dir(folder: Path) -> Path:
    """The working dir the tests upload: script.py, verl_style.py and helper.py."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "script.py").write_text(SCRIPT)
    (folder / "verl_style.py").write_text(VERL_STYLE)
    (folder / "helper.py").write_text(HELPER)
    return folder


#: verl's own runtime env file (verl/trainer/runtime_env.yaml), which its multi-node guide
#: passes to `ray job submit --runtime-env`.
VERL_RUNTIME_ENV = textwrap.dedent('''
    working_dir: ./
    excludes: ["/.git/"]
    env_vars:
      TORCH_NCCL_AVOID_RECORD_STREAMS: "1"
      CUDA_DEVICE_MAX_CONNECTIONS: "1"
''')
#: A stand-in for ``verl.trainer.main_ppo``: run with ``python3 -m trainer.main_ppo KEY=VALUE...``.
MAIN_PPO = textwrap.dedent('''
    import os, sys
    import ray

    ray.init()
    print("MAIN_PPO", sys.argv[1:], os.environ["CUDA_DEVICE_MAX_CONNECTIONS"],
          sorted(ray.cluster_resources()), flush=True)
''')


def write_verl_layout(folder: Path) -> Path:
    """A repository shaped like verl's for its multi-node command: ``trainer/main_ppo.py``,
    ``trainer/runtime_env.yaml`` (verl's), and a ``.git`` folder the runtime env excludes."""
    (folder / "trainer").mkdir(parents=True, exist_ok=True)
    (folder / "trainer" / "__init__.py").write_text("")
    (folder / "trainer" / "main_ppo.py").write_text(MAIN_PPO)
    (folder / "trainer" / "runtime_env.yaml").write_text(VERL_RUNTIME_ENV)
    (folder / ".git").mkdir(exist_ok=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return folder


def write_py_module(folder: Path) -> Path:
    """A package ``extra`` (``extra.VALUE``) to ship with ``py_modules``: its folder."""
    package = folder / "extra"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("VALUE = 'from py_modules'\n")
    return package


@dataclass
class UpCluster:
    """A cluster started with ``podium up``: its HTTP URL, token and environment."""

    dir: Path
    http_url: str
    token: str
    env: dict

    def get(self, path: str, token: str | None = None):
        """GET a JSON document (with the token unless ``token`` is ""), (status, doc)."""
        token = self.token if token is None else token
        request = urllib.request.Request(self.http_url + path,
                                         headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def job(self, job_id: str) -> dict:
        """A job's JobDetails."""
        status, doc = self.get(f"/api/jobs/{job_id}")
        assert status == 200, doc
        return doc

    def logs(self, job_id: str) -> str:
        """A job's logs ("" while there is no such job yet)."""
        status, doc = self.get(f"/api/jobs/{job_id}/logs")
        return doc["logs"] if status == 200 else ""

    def wait_job(self, job_id: str, statuses: set[str], timeout: float = 180) -> dict:
        """The job once its status is one of ``statuses`` (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            doc = self.job(job_id)
            if doc["status"] in statuses:
                return doc
            assert time.monotonic() < deadline, f"{job_id} is {doc['status']}, not {statuses}: {doc['message']}"
            time.sleep(0.2)

    def live_workers(self) -> list[dict]:
        """Workers STARTING, RUNNING or STOPPING."""
        _, doc = self.get("/v1/workers")
        return [w for w in doc["workers"]
                if w["state"] in ("WORKER_STARTING", "WORKER_RUNNING", "WORKER_STOPPING")]

    def placement_groups(self) -> list[dict]:
        """Placement groups not removed."""
        _, doc = self.get("/v1/placement")
        return doc["placement_groups"]

    def left_behind(self, driver_pgid: int, worker_pids: list[int]) -> dict:
        """What a job left: placement groups, live workers, processes of its driver's group,
        and worker processes still alive (each empty when it left nothing)."""
        return {"placement_groups": [g["id"] for g in self.placement_groups()],
                "workers": [w["id"] for w in self.live_workers()],
                "driver_processes": members_of_groups({driver_pgid}),
                "worker_processes": [p for p in worker_pids if alive(p)]}


def where_program(module: str) -> str:
    """A job's driver that prints where it and its actor run (``sys.prefix``: the pip set's
    virtualenv) and ``module``'s VALUE seen by each (a package of that set)."""
    return textwrap.dedent(f"""
        import shutil, sys
        import ray
        import {module}

        ray.init()

        @ray.remote(num_cpus=1)
        class Where:
            def get(self):
                import {module}
                return {module}.VALUE, sys.prefix

        print("DRIVER", {module}.VALUE, sys.prefix, shutil.which("python"), flush=True)
        print("ACTOR", *ray.get(Where.remote().get.remote()), flush=True)
    """)


def podium(*args: str, env: dict, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """``podium ARGS`` run to its end."""
    return subprocess.run([sys.executable, "-m", "podium.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def start_up(tmp_path: Path, token: str, nodes: int = 2) -> UpCluster:
    """``podium up`` with ``nodes`` nodes of one fake GPU and 4 CPUs each, on free ports."""
    env = dict(os.environ, PODIUM_TOKEN=token, PYTHONUNBUFFERED="1")
    env.pop("PODIUM_ADDRESS", None)
    folder = tmp_path / "cluster"
    up = podium("up", "--dir", str(folder), "--nodes", str(nodes), "--gpus-per-node", "1",
                "--cpus-per-node", "4", "--port", "0", "--http-port", "0", env=env)
    assert up.returncode == 0, up.stderr
    cluster = json.loads((folder / "cluster.json").read_text())
    return UpCluster(dir=folder, http_url=cluster["http_url"], token=token, env=env)


def stop_up(cluster: UpCluster) -> None:
    """``podium down`` (its SIGKILL after the grace included)."""
    podium("down", "--dir", str(cluster.dir), "--grace", "10", env=cluster.env)
