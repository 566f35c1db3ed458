"""The controller on a 2-node loopback cluster of real processes.

A ``podium scheduler`` and two ``podium node`` agents (on 127.0.0.2 and 127.0.0.3, 2 fake
GPUs each) run as separate processes; the controller joins with ``init(address=...)``.
"""

from __future__ import annotations

import os

import pytest
import torch

from podium.controller import (ClassWithInitArgs, ResourcePool, WorkerGroup, make_nd_compute_dataproto_dispatch_fn)
from podium.dataproto import DataProto
from podium.worker import Dispatch, Worker, register
from tests.support.clusters import controller_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


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


@pytest.fixture(scope="module")
def remote_cluster(tmp_path_factory):
    # 2 GPUs per node: the pool's two placement groups land on different nodes.
    with controller_cluster("two_nodes", tmp_path_factory.mktemp("cluster"), gpus_per_node=2):
        yield


def test_mesh_dispatch_over_two_nodes_in_address_order(remote_cluster):
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
