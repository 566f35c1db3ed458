"""MASTER_PORT cannot be stolen (issue 51): a port thief holds every port of the kernel's
ephemeral range it can on rank 0's node, and takes each one that comes free, while a group
starts and forms its gloo group. Before, the agent reserved MASTER_PORT in that range and
released it just before the worker started: the thief (any outgoing connection on a busy
host) took it, rank 0 got EADDRINUSE and the other ranks waited 30 minutes for its store."""

from __future__ import annotations

import subprocess
import sys

import pytest

from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.worker import Dispatch, Worker, register
from podium.worker.agent.ports import ephemeral_range
from tests.support.clusters import controller_cluster
from tests.support.waiting import REPO

torch = pytest.importorskip("torch")


class Gloo(Worker):
    """Forms a gloo group from the env Podium sets and all-reduces once."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def allreduce(self):
        import datetime

        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()


def test_a_port_thief_cannot_take_master_port(tmp_path):
    with controller_cluster("two_nodes", tmp_path, gpus_per_node=2):
        pool = ResourcePool([2, 2], use_gpu=False)
        wg = WorkerGroup(pool, ClassWithInitArgs(Gloo))
        try:
            low, high = ephemeral_range()
            assert not low <= int(wg.master_port) <= high
            proc = subprocess.Popen([sys.executable, "-m", "tests.support.portthief", wg.master_address],
                                    cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                line = proc.stdout.readline()
                assert line.startswith("bound ") and int(line.split()[1]) > 0, line
                # Every free ephemeral port of the node is the thief's now, and stays so.
                assert wg.allreduce() == [10.0] * 4
            finally:
                proc.stdin.close()
                proc.wait(timeout=30)
        finally:
            wg.shutdown()
