"""Run under ``podium run`` with ``PODIUM_RAY_DIR`` and ``PODIUM_TOKEN`` set: ROLL's log monitor
(roll/distributed/scheduler/log_monitor.py) as its launcher uses it, with plain ``import ray``:
``ray start --head``, ``ray.init(address=..., log_to_driver=False)``, the logs folder found
from ``ray.nodes()[0]["ObjectStoreSocketName"]``, a subclass of Ray's ``LogMonitor`` that
overrides ``update_log_filenames`` as ROLL's does, run in a daemon thread, and a publisher that
prints each batch with ``print_to_stdstream`` and keeps it. Two named actors write to stdout and
stderr; their lines must come back under their names, with their pids, once each. Prints
``LOG MONITOR OK`` last."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import threading
import time

import ray
from ray._private.log_monitor import (
    RAY_RUNTIME_ENV_LOG_TO_DRIVER_ENABLED,
    RUNTIME_ENV_SETUP_PATTERN,
    WORKER_LOG_PATTERN,
    LogFileInfo,
    is_proc_alive,
)
from ray._private.log_monitor import LogMonitor as RayLogMonitor
from ray._private.worker import logger as monitor_logger  # noqa: F401 - ROLL imports it
from ray._private.worker import print_to_stdstream


def sh(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)


class Publisher:
    """ROLL's StdPublisher, keeping what it printed."""

    batches: list = []
    lock = threading.Lock()

    @staticmethod
    def publish_logs(data: dict) -> None:
        print_to_stdstream(data, ignore_prefix=False)
        with Publisher.lock:
            Publisher.batches.append(data)


class LogMonitor(RayLogMonitor):
    """ROLL's override: which files to follow, as Ray 2.x lists them."""

    def update_log_filenames(self):
        paths = glob.glob(f"{self.logs_dir}/worker*[.out|.err]") + glob.glob(f"{self.logs_dir}/raylet*.err")
        if not self.is_autoscaler_v2:
            paths += glob.glob(f"{self.logs_dir}/monitor.log")
        paths += glob.glob(f"{self.logs_dir}/gcs_server*.err")
        if RAY_RUNTIME_ENV_LOG_TO_DRIVER_ENABLED:
            paths += glob.glob(f"{self.logs_dir}/runtime_env*.log")
        for path in paths:
            if os.path.isfile(path) and path not in self.log_filenames:
                match = WORKER_LOG_PATTERN.match(path)
                job = None
                if "runtime_env" in path:
                    job_match = RUNTIME_ENV_SETUP_PATTERN.match(path)
                    job = job_match.group(1) if job_match else None
                self.log_filenames.add(path)
                self.closed_file_infos.append(LogFileInfo(
                    filename=path, size_when_last_opened=0, file_position=0, file_handle=None,
                    is_err_file=path.endswith("err"), job_id=job,
                    worker_pid=int(match.group(2)) if match else None))


@ray.remote(num_cpus=0.5)
class Talker:
    """Writes numbered lines to stdout and stderr."""

    def say(self, tag: str, n: int) -> int:
        import sys
        for i in range(n):
            print(f"{tag} out {i}", flush=True)
            print(f"{tag} err {i}", file=sys.stderr, flush=True)
        return os.getpid()


head = sh("ray start --head --port=0 --node-name=head --dashboard-port=0")
assert head.returncode == 0, head.stdout + head.stderr
address = re.search(r"scheduler is at (\S+?)\.\n", head.stdout).group(1)
ray.init(address=address, namespace="roll", ignore_reinit_error=True, log_to_driver=False)

logs_dir = os.path.join(os.path.dirname(os.path.dirname(ray.nodes()[0]["ObjectStoreSocketName"])), "logs")
assert logs_dir.startswith(os.environ["PODIUM_RAY_DIR"]), logs_dir
monitor = LogMonitor(node_ip_address=ray.util.get_node_ip_address(), logs_dir=logs_dir, gcs_client=Publisher(),
                     is_proc_alive_fn=is_proc_alive)
threading.Thread(target=monitor.run, daemon=True).start()

alpha, beta = Talker.options(name="alpha").remote(), Talker.options(name="beta").remote()
pids = {"alpha": ray.get(alpha.say.remote("alpha", 3)), "beta": ray.get(beta.say.remote("beta", 2))}


def lines_of(name: str, is_err: bool) -> list:
    """The actor's own lines (its stderr also holds Podium's worker host log lines)."""
    with Publisher.lock:
        return [line for b in Publisher.batches if b["actor_name"] == name and b["is_err"] == is_err
                for line in b["lines"] if line.startswith(name)]


deadline = time.monotonic() + 60
while time.monotonic() < deadline and not all(
        len(lines_of(n, e)) >= c for n, c in (("alpha", 3), ("beta", 2)) for e in (False, True)):
    time.sleep(0.2)
for name, count in (("alpha", 3), ("beta", 2)):
    assert lines_of(name, False) == [f"{name} out {i}" for i in range(count)], (name, Publisher.batches)
    assert lines_of(name, True) == [f"{name} err {i}" for i in range(count)], (name, Publisher.batches)
    with Publisher.lock:
        assert {b["pid"] for b in Publisher.batches if b["actor_name"] == name} == {pids[name]}
links = glob.glob(f"{logs_dir}/worker-*")
assert all(os.path.islink(p) for p in links) and len(links) >= 4, links

# A killed actor's files move to logs_dir/old when the monitor closes its files (Ray's rule);
# nothing it wrote is published twice.
ray.kill(beta)
deadline = time.monotonic() + 60
while time.monotonic() < deadline and is_proc_alive(pids["beta"]):
    time.sleep(0.2)
assert not is_proc_alive(pids["beta"])
monitor.can_open_more_files = False  # the next pass closes every file, as when the limit is reached
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not glob.glob(f"{logs_dir}/old/worker-*-{pids['beta']}.out"):
    time.sleep(0.2)
assert glob.glob(f"{logs_dir}/old/worker-*-{pids['beta']}.out"), os.listdir(logs_dir)
ray.get(alpha.say.remote("alpha-again", 1))
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not lines_of("alpha", True)[3:]:
    time.sleep(0.2)
assert lines_of("alpha", True) == [f"alpha err {i}" for i in range(3)] + ["alpha-again err 0"], Publisher.batches
assert lines_of("beta", False) == ["beta out 0", "beta out 1"], Publisher.batches
monitor.stop()
ray.shutdown()
assert sh("ray stop --force").returncode == 0
print("LOG MONITOR OK")
