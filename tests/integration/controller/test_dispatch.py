"""Every dispatch mode through real worker processes, on two clusters.

Every test runs twice: on the embedded cluster (``init()``: scheduler + one node agent as
child processes, 8 fake GPUs) and on a 2-node loopback cluster of real processes
(127.0.0.2 and 127.0.0.3), where the 4 ranks span both nodes. One 4-rank WorkerGroup per
cluster serves every test; the cluster is shut down at the end.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import podium
from podium.controller import (ClassWithInitArgs, ResourcePool, WorkerGroup, make_nd_compute_dataproto_dispatch_fn)
from podium.errors import RemoteError
from podium.dataproto import DataProto
from podium.worker import Dispatch, Execute, Worker, register
from tests.support.clusters import TWO_NODES, controller_cluster

pytestmark = pytest.mark.timeout(300)


def _two_per_rank(worker_group, x):
    return ([x, x + 2] * (worker_group.world_size // 2),), {}


def _collect_sorted(worker_group, outputs):
    return sorted(outputs)


class Echo(Worker):
    """A worker with one method per dispatch mode."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        # [dp=2, tp=2]: ranks 0,1 are dp 0 and ranks 2,3 dp 1; tp 0 collects
        self._register_dispatch_collect_info("mesh", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)
        # dp ranks that decrease with the rank: verl would return rows permuted
        self._register_dispatch_collect_info("rev", dp_rank=1 - self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def one(self, x, y=0):
        return (self.rank, x, y)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def every(self, x):
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def dp(self, x):
        return x * 10 + self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_rank(self, data):
        data.batch["a"] += self.rank + self.offset
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data):
        return {"rank": self.rank, "rows": len(data)}

    @register(dispatch_mode={"dispatch_fn": _two_per_rank, "collect_fn": _collect_sorted})
    def custom(self, x):
        return x + self.rank

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("mesh"))
    def mesh_add(self, data):
        data.batch["a"] += 100 * self.rank
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("rev"))
    def rev_add(self, data):
        data.batch["a"] += 100 * self.rank
        return data

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rank0(self, x):
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rank0_one(self, x):
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def leader_only(self, x):
        """Rank 0 only by its registration, not by its name."""
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def execute_rank_zero_stats(self, x):
        """Every rank, although its name says rank zero."""
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self, keys):
        import torch
        return {"torch_threads": torch.get_num_threads(), **{k: os.environ.get(k) for k in keys}}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail(self):
        if self.rank == 1:
            raise ValueError(f"boom from rank {self.rank}")
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def allreduce(self):
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        gathered = torch.zeros(2 * self.world_size)
        dist.all_gather_into_tensor(gathered, torch.tensor([float(self.rank)] * 2))
        return t.item(), gathered.tolist()

    def plain(self, x):
        """Not registered: callable through execute_all_sync only."""
        return x * 2 + self.rank


#: What the group looks like on each cluster: the pool, the worker names, the group's process
#: count per node, each rank's GPU and rank 0's node. On two nodes the ranks span both.
LAYOUTS = {
    "embedded": {"pool": [4], "names": [f"echoEcho_0:{i}" for i in range(4)], "local": "4",
                 "gpus": ["0", "1", "2", "3"], "master": "127.0.0.1"},
    "two_nodes": {"pool": [2, 2], "names": ["echoEcho_0:0", "echoEcho_0:1", "echoEcho_1:0", "echoEcho_1:1"],
                  "local": "2", "gpus": ["0", "1", "0", "1"], "master": TWO_NODES[0]},
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, tmp_path_factory):
    # 2 GPUs per node: the pool's two placement groups cannot share a node.
    with controller_cluster(request.param, tmp_path_factory.mktemp(request.param), gpus_per_node=2):
        yield LAYOUTS[request.param]


@pytest.fixture(scope="module")
def wg(layout):
    group = WorkerGroup(ResourcePool(layout["pool"], use_gpu=True, max_colocate_count=4),
                        ClassWithInitArgs(Echo, offset=0), name_prefix="echo")
    yield group
    group.shutdown()


def proto(n: int, padding: bool = False) -> DataProto:
    return DataProto.from_dict(tensors={"a": torch.zeros(n, dtype=torch.long)},
                               non_tensors={"s": np.array([str(i) for i in range(n)], dtype=object)},
                               auto_padding=padding)


def test_surface(wg, layout):
    assert wg.world_size == 4
    assert wg.worker_names == layout["names"]
    assert [w.rank for w in wg.workers] == [0, 1, 2, 3]
    assert wg.master_address == layout["master"] and int(wg.master_port) > 0
    assert type(wg.add_rank).__name__ == "add_rank"
    assert not hasattr(wg, "plain")


def test_one_to_all_and_all_to_all(wg):
    assert wg.one(7, y=1) == [(r, 7, 1) for r in range(4)]
    assert wg.every([10, 11, 12, 13]) == [(r, 10 + r) for r in range(4)]
    assert wg.every(5) == [(r, 5) for r in range(4)]
    assert wg.every((1, 2, 3, 4)) == [(r, (1, 2, 3, 4)) for r in range(4)]


@pytest.mark.parametrize("value", [[1, 2, 3, 4], (1, 2, 3, 4)])
def test_dp_compute(wg, value):
    assert wg.dp(value) == [10, 21, 32, 43]


def test_dp_compute_proto_with_padding_keeps_the_callers_batch(wg):
    data = proto(10, padding=True)
    out = wg.add_rank(data)
    assert out.batch["a"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert out.non_tensor_batch["s"].tolist() == [str(i) for i in range(10)]
    assert len(data) == 10 and data.batch["a"].tolist() == [0] * 10
    assert wg.add_rank(proto(8)).batch["a"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_metric_keeps_ranks_with_real_rows(wg):
    assert [m["rows"] for m in wg.metric(proto(10, padding=True))] == [3, 3, 3, 3]
    assert [m["rank"] for m in wg.metric(proto(1, padding=True))] == [0]


def test_custom_dict_mode(wg):
    assert wg.custom(8) == [8, 10, 11, 13]


def test_with_func_generator(wg):
    def plus_ten(worker, data):
        data.batch["a"] += 10 + worker.rank
        return data

    assert wg.execute_with_func_generator(plus_ten, proto(4)).batch["a"].tolist() == [10, 11, 12, 13]


def test_mesh_dispatch_dp2_tp2(wg):
    data = DataProto.from_dict(tensors={"a": torch.tensor([1, 2])})
    # dp 0 (ranks 0, 1) gets [1], dp 1 (ranks 2, 3) gets [2]; ranks 0 and 2 collect
    assert wg.mesh_add(data).batch["a"].tolist() == [1, 202]
    assert wg._dispatch_info["mesh"] == [0, 0, 1, 1]
    assert wg._collect_info["mesh"] == [True, False, True, False]
    # keyword-only call
    assert wg.mesh_add(data=data).batch["a"].tolist() == [1, 202]


def test_mesh_collect_in_dp_order(wg):
    data = DataProto.from_dict(tensors={"a": torch.tensor([1, 2])})
    # rank 2 is dp 0 (gets 1, adds 200), rank 0 is dp 1 (gets 2, adds 0): dp order -> [201, 2]
    assert wg.rev_add(data).batch["a"].tolist() == [201, 2]


def test_execute_rank_zero(wg):
    assert wg.rank0(5) == (0, 5)
    assert wg.rank0_one(7) == (0, 7)  # verl sends rank 0 [7, 7, 7, 7]
    assert wg.execute_rank_zero_sync("plain", 3) == 6
    assert wg.execute_func_rank_zero(lambda a, b: a + b, 2, 3) == 5
    assert podium.get(wg.execute_rank_zero("plain", 1)) == 2


def test_rank_zero_is_the_registered_execute_mode_not_the_name(wg):
    assert wg.leader_only(3) == (0, 3)
    assert wg.execute_rank_zero_stats(4) == [(r, 4) for r in range(4)]


def test_execute_all_sync_and_async(wg):
    assert wg.execute_all_sync("plain", 1) == [2, 3, 4, 5]
    assert wg.execute_all_sync("plain", [1, 2, 3, 4]) == [2, 5, 8, 11]
    refs = wg.execute_all_async("plain", 0)
    assert podium.get(refs) == [0, 1, 2, 3]


def test_remote_error_names_rank_and_traceback(wg):
    with pytest.raises(RemoteError) as info:
        wg.fail()
    err = info.value
    assert err.rank == 1
    assert "boom from rank 1" in str(err)
    assert "ValueError" in err.remote_type
    assert "in fail" in err.traceback  # by-value code has no source lines
    assert wg.one(1)[0] == (0, 1, 0)  # still serving


def test_env_each_rank_sees(wg, layout):
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PODIUM_LOCAL_WORLD_SIZE",
            "RAY_LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "WG_PREFIX", "WG_BACKEND",
            "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"]
    envs = wg.env(keys)
    for rank, env in enumerate(envs):
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "1"
        assert env["PODIUM_LOCAL_WORLD_SIZE"] == env["RAY_LOCAL_WORLD_SIZE"] == layout["local"]
        assert env["MASTER_ADDR"] == wg.master_address and env["MASTER_PORT"] == str(wg.master_port)
        assert env["WG_PREFIX"] == "echo" and env["WG_BACKEND"] == "podium"
        assert env["CUDA_VISIBLE_DEVICES"] == layout["gpus"][rank]
        # one CPU per worker: one math-library thread (also in workers forked from a helper
        # that imported torch before the variable was set)
        assert env["OMP_NUM_THREADS"] == "1" and env["torch_threads"] == 1


def test_torch_distributed_gloo(wg):
    results = wg.allreduce()
    assert [r[0] for r in results] == [10.0] * 4
    assert results[0][1] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_non_blocking_and_wait(wg):
    future = wg.execute_all_async("plain", 5)
    ready, not_ready = podium.wait(future, num_returns=4, timeout=60)
    assert len(ready) == 4 and not not_ready
    assert podium.get(ready) == [10, 11, 12, 13]


def test_a_shard_several_ranks_receive_is_encoded_once(wg, monkeypatch):
    import podium.worker.caller.client as client_module
    encoded = []
    real = client_module.prepare

    def counting(value):
        encoded.append(value)
        return real(value)

    monkeypatch.setattr(client_module, "prepare", counting)
    wg.one(torch.zeros(1000))
    assert len(encoded) == 1  # ONE_TO_ALL: one payload for 4 ranks
    encoded.clear()
    wg.mesh_add(DataProto.from_dict(tensors={"a": torch.tensor([1, 2])}))
    assert len(encoded) == 2  # one per dp replica, not one per tp rank
