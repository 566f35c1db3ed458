"""Run under ``podium run`` with ``PODIUM_RAY_DIR`` and ``PODIUM_TOKEN`` set: ROLL's launcher
steps (roll/distributed/scheduler/initialize.py) on Podium's ``ray`` command. Prints
``RAY CLI OK`` last."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import ray


def sh(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)


assert shutil.which("ray", path=os.environ["PATH"]).endswith("raybin/ray")
status = sh("ray status")  # ROLL's is_ray_cluster_running(): none yet
assert status.returncode != 0 and "Connection refused" in status.stderr, status
assert sh("ray frobnicate").returncode == 2
refused = sh("ray start --head --resources='{\"x\": 1}'")
assert refused.returncode == 2 and "not supported by Podium" in refused.stderr, refused

head = sh("ray start --head --port=0 --node-name=head --dashboard-port=0 --disable-usage-stats")
assert head.returncode == 0, head.stdout + head.stderr
address = re.search(r"scheduler is at (\S+?)\.\n", head.stdout).group(1)
again = sh(f"ray start --head --port=0")
assert again.returncode == 1 and "ray stop" in again.stderr, again
worker = sh(f"ray start --address={address} --node-ip-address=127.0.0.2 --node-name=second --num-cpus=2")
assert worker.returncode == 0, worker.stdout + worker.stderr

ray.init(address=address, namespace="roll", ignore_reinit_error=True, log_to_driver=False,
         runtime_env={"env_vars": {"ROLL_TEST": "1"}})
alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
assert alive == {"head", "second"}, alive


@ray.remote(num_cpus=1)
class Echo:
    """An actor on the cluster ray start made."""

    def where(self) -> str:
        return os.environ.get("ROLL_TEST", "") + "@" + ray.get_runtime_context().get_node_id()


echo = Echo.options(name="echo").remote()
assert ray.get(echo.where.remote()).startswith("1@"), "the actor did not run"
shown = sh("ray status")
assert shown.returncode == 0 and "head" in shown.stdout and "second" in shown.stdout, shown
ray.shutdown()

stopped = sh("ray stop --force")
assert stopped.returncode == 0 and "Stopped all 3" in stopped.stdout, stopped
after = sh("ray status")
assert after.returncode != 0, after
print("RAY CLI OK")
