"""``ray start`` under ``podium run --num-cpus N --num-gpus M`` (ROLL's launcher, issue #49 item
12): the node it starts offers N CPUs and M fake GPUs, as the embedded cluster would, so a
launcher that starts its own cluster is sized like one that lets ``ray.init()`` start it."""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = r"""
import re, subprocess
import ray
head = subprocess.run("ray start --head --port=0 --dashboard-port=0", shell=True, capture_output=True, text=True)
assert head.returncode == 0, head.stdout + head.stderr
ray.init(address=re.search(r"scheduler is at (\S+?)\.\n", head.stdout).group(1))
total = ray.cluster_resources()
assert total["GPU"] == 3 and total["CPU"] == 5, total
@ray.remote(num_gpus=1)
def gpus():
    return ray.get_gpu_ids()
assert len(ray.get(gpus.remote())) == 1
ray.shutdown()
assert subprocess.run("ray stop --force", shell=True).returncode == 0
print("SIZED OK")
"""


def test_ray_start_under_podium_run_offers_its_cpus_and_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_ADDRESS", "PODIUM_TOKEN_FILE")}
    env.update(PODIUM_RAY_DIR=str(tmp_path / "ray"), PODIUM_TOKEN="ray-start-size-token")
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "5", "--num-gpus", "3", "--",
                          sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert run.returncode == 0 and "SIZED OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
    finally:
        subprocess.run([sys.executable, "-m", "podium.compat.raycli", "stop", "--force"], env=env,
                       capture_output=True, timeout=60)
