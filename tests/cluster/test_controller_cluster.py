"""The controller on a 2-node loopback cluster of real processes.

A ``podium scheduler`` and two ``podium node`` agents (on 127.0.0.2 and 127.0.0.3, 2 fake
GPUs each) run as separate processes; the controller joins with ``init(address=...)``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
import torch

from podium import controller
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup, make_nd_compute_dataproto_dispatch_fn
from podium.protocol import DataProto
from podium.worker import Dispatch, Worker, register

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

NODES = ("127.0.0.3", "127.0.0.2")  # started in this order: ranks must still follow address order


class MeshWorker(Worker):
    """DP=2 x TP=2: ranks 0,1 are dp 0, ranks 2,3 dp 1; tp 0 collects."""

    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("train", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def train(self, data):
        return DataProto.from_dict(tensors={
            "x": data.batch["x"] * 10,
            "rank": torch.full((len(data),), self.rank),
            "node": torch.full((len(data),), int(os.environ["PODIUM_NODE_ADDRESS"].rsplit(".", 1)[1]))})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self):
        return {k: os.environ.get(k) for k in ("RANK", "PODIUM_NODE_ADDRESS", "MASTER_ADDR",
                                               "PODIUM_LOCAL_WORLD_SIZE", "WORLD_SIZE")}


def _wait_file(path, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        time.sleep(0.05)
    raise TimeoutError(f"{path} not written within {timeout}s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    token = secrets.token_urlsafe(16)
    env = dict(os.environ, PODIUM_TOKEN=token)
    env.pop("PODIUM_TOKEN_FILE", None)
    procs = []

    def start(args, name):
        log = open(tmp / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "podium.cli", *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(proc)
        return proc

    try:
        sched = start(["scheduler", "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--state",
                       ":memory:", "--port-file", str(tmp / "sched.json")], "scheduler")
        port = _wait_file(tmp / "sched.json", sched)["port"]
        for host in NODES:
            agent = start(["node", "--scheduler", f"127.0.0.1:{port}", "--host", host, "--fake-gpus", "2",
                           "--cpus", "16", "--port-file", str(tmp / f"{host}.json"),
                           "--log-dir", str(tmp / host)], host)
            _wait_file(tmp / f"{host}.json", agent)
        rt = controller.init(address=f"127.0.0.1:{port}", token=token)
        deadline = time.monotonic() + 30
        while len(rt.run(rt.cluster_state()).nodes) < 2:
            assert time.monotonic() < deadline, "nodes did not register"
            time.sleep(0.1)
        yield rt
    finally:
        controller.shutdown()
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def test_mesh_dispatch_over_two_nodes_in_address_order(cluster):
    wg = WorkerGroup(ResourcePool([2, 2], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(MeshWorker))
    try:
        where = wg.where()
        assert [w["RANK"] for w in where] == ["0", "1", "2", "3"]
        assert [w["PODIUM_NODE_ADDRESS"] for w in where] == ["127.0.0.2"] * 2 + ["127.0.0.3"] * 2
        assert {w["MASTER_ADDR"] for w in where} == {"127.0.0.2"}
        assert {w["PODIUM_LOCAL_WORLD_SIZE"] for w in where} == {"2"}
        assert wg.master_address == "127.0.0.2"

        out = wg.train(DataProto.from_dict(tensors={"x": torch.arange(6)}))
        # dp 0 (ranks 0,1 on .2) gets rows 0..2, dp 1 (ranks 2,3 on .3) rows 3..5; tp 0 collects
        assert out.batch["x"].tolist() == [0, 10, 20, 30, 40, 50]
        assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2, 2]
        assert out.batch["node"].tolist() == [2, 2, 2, 3, 3, 3]
    finally:
        wg.shutdown()
