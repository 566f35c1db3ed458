"""MASTER_PORT cannot be stolen (issue 51): port thieves hold every port of the kernel's
ephemeral range while a group starts and forms its gloo group (tests.support.portthief says
how). Before, the agent reserved MASTER_PORT in that range and released it just before the
worker started; any outgoing connection on a busy host could take it in between: rank 0 got
EADDRINUSE and the other ranks waited 30 minutes for its store."""

from __future__ import annotations

import pytest

from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.worker import Dispatch, Worker, register
from podium.worker.agent.ports import ephemeral_range
from tests.support.clusters import controller_cluster
from tests.support import portthief

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
    low, high = ephemeral_range()
    with controller_cluster("two_nodes", tmp_path, gpus_per_node=2):
        thieves = portthief.start(low, high)
        try:
            wg = WorkerGroup(ResourcePool([2, 2], use_gpu=False), ClassWithInitArgs(Gloo))
            try:
                assert wg.allreduce() == [10.0] * 4
                assert not low <= int(wg.master_port) <= high
            finally:
                wg.shutdown()
        finally:
            portthief.stop(thieves)
