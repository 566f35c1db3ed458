"""WorkerGroup lifecycle: futures between groups, colocation, pools, errors (slot full,
infeasible, dead worker), worker_env and from_detached; on the embedded cluster and on a
2-node loopback cluster of real processes."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch

import podium
from podium.controller import (ClassWithInitArgs, ResourcePool, ResourcePoolManager, WorkerGroup, create_colocated_worker_cls)
from podium import DataProtoFuture
from podium.controller.session.runtime import get_runtime
from podium.errors import InfeasibleError, SlotFullError, WorkerDiedError
from podium.dataproto import DataProto
from podium.worker import Dispatch, Worker, register
from tests.support.clusters import controller_cluster
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(300)


class Producer(Worker):
    """Makes rows and keeps them (blocking=False)."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, data):
        data.batch["a"] += self.rank
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def info(self):
        return {"pid": os.getpid(), "rank": self.rank, "env": {k: os.environ.get(k) for k in (
            "WORLD_SIZE", "PODIUM_LOCAL_WORLD_SIZE", "FOO", "CUDA_VISIBLE_DEVICES", "PODIUM_NODE_ADDRESS")}}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def die(self):
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.rank


class Consumer(Worker):
    """Receives a future: the worker fetches its rows from the producers itself."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def consume(self, data):
        return DataProto.from_dict(tensors={"a": data.batch["a"] * 10,
                                            "rank": torch.full((len(data),), self.rank)})


class Actor(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x):
        return x + self.rank, os.getpid()


class Critic(Worker):
    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    async def sub(self, x):
        return x - self.rank, os.getpid()


class Bad(Worker):
    def __init__(self):
        super().__init__()
        raise RuntimeError("constructor failed on purpose")


class RankZeroDispatch(Worker):
    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def nope(self):
        return 0


@pytest.fixture(scope="module", autouse=True, params=["embedded", "two_nodes"])
def lifecycle_cluster(request, tmp_path_factory):
    """Every test runs on the embedded cluster and on 2 loopback nodes (4 fake GPUs each)."""
    with controller_cluster(request.param, tmp_path_factory.mktemp(request.param)):
        yield request.param


def worker_count() -> int:
    rt = get_runtime()
    return len([w for w in rt.run(rt.cluster_state()).workers if w.state in (1, 2)])


def test_the_import_heap_is_frozen_while_the_runtime_is_up():
    import gc
    assert get_runtime().gc_frozen and gc.get_freeze_count() > 0


def test_future_between_groups_is_fetched_worker_to_worker():
    producers = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=2), ClassWithInitArgs(Producer))
    consumers = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=2), ClassWithInitArgs(Consumer))
    try:
        data = DataProto.from_dict(tensors={"a": torch.arange(10)}, auto_padding=True)
        future = producers.make(data)  # returns at once
        assert isinstance(future, DataProtoFuture)
        rt = get_runtime()
        before = dict(rt.stats)
        out = consumers.consume(future)
        # each consumer got 5 rows straight from the producers: nothing went through here
        assert (rt.stats["fetches"], rt.stats["fetched_bytes"]) == (before["fetches"], before["fetched_bytes"])
        assert out.batch["a"].tolist() == [10 * (i + (0 if i < 5 else 1)) for i in range(10)]
        assert out.batch["rank"].tolist() == [0] * 5 + [1] * 5
        # the future is unpadded (10 rows, not 12) and can be fetched here too
        assert len(future.get()) == 10
        assert rt.stats["fetches"] > before["fetches"]
    finally:
        producers.shutdown()
        consumers.shutdown()


def test_colocated_roles_and_spawn_share_processes():
    cls = create_colocated_worker_cls({"actor": ClassWithInitArgs(Actor), "critic": ClassWithInitArgs(Critic)})
    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=2), cls, name_prefix="colo")
    try:
        assert wg.worker_names == ["coloWorkerDict_0:0", "coloWorkerDict_0:1"]
        views = wg.spawn({"actor", "critic"})
        adds = views["actor"].add(10)
        subs = views["critic"].sub([10, 20])
        assert [v for v, _ in adds] == [10, 11] and [v for v, _ in subs] == [10, 19]
        assert [p for _, p in adds] == [p for _, p in subs]  # both roles answer from one pid per rank
        assert [v for v, _ in wg.actor_add(1)] == [1, 2]
        views["actor"].shutdown()  # a view only disconnects
        assert [v for v, _ in wg.actor_add(1)] == [1, 2]
    finally:
        wg.shutdown()


def test_heterogeneous_pool_2_4():
    wg = WorkerGroup(ResourcePool([2, 4], use_gpu=True, max_colocate_count=2), ClassWithInitArgs(Producer),
                     bin_pack=False)
    try:
        infos = wg.info()
        assert wg.world_size == 6 and len(infos) == 6
        assert {i["env"]["WORLD_SIZE"] for i in infos} == {"6"}
        local = sorted(int(i["env"]["PODIUM_LOCAL_WORLD_SIZE"]) for i in infos)
        assert local == [6] * 6 or local == [2, 2, 4, 4, 4, 4]  # one node holds both groups
        # six distinct GPUs: (node, index) pairs, since indices repeat across nodes
        assert len({(i["env"]["PODIUM_NODE_ADDRESS"], i["env"]["CUDA_VISIBLE_DEVICES"]) for i in infos}) == 6
    finally:
        wg.shutdown()


def test_worker_env():
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Producer),
                    worker_env={"WORLD_SIZE": "3"})
    wg = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Producer),
                     worker_env={"FOO": "bar"})
    try:
        assert wg.info()[0]["env"]["FOO"] == "bar"
    finally:
        wg.shutdown()


def test_full_colocation_slot_fails_fast():
    pool = ResourcePool([1], use_gpu=True, max_colocate_count=1)
    first = WorkerGroup(pool, ClassWithInitArgs(Producer))
    try:
        before = worker_count()
        with pytest.raises(SlotFullError):
            WorkerGroup(pool, ClassWithInitArgs(Producer))
        assert worker_count() == before
    finally:
        first.shutdown()


def test_infeasible_pool_before_any_process():
    before = worker_count()
    with pytest.raises(InfeasibleError):
        WorkerGroup(ResourcePool([9], use_gpu=True), ClassWithInitArgs(Producer))
    manager = ResourcePoolManager({"global_pool": [8], "reward": [2]}, {"actor": "global_pool"})
    with pytest.raises(InfeasibleError) as info:
        manager.create_resource_pool()
    assert info.value.node_reasons
    assert worker_count() == before


def test_constructor_error_is_remote_error_and_tears_down():
    from podium.errors import RemoteError
    before = worker_count()
    with pytest.raises(RemoteError, match="constructor failed on purpose"):
        WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Bad))
    eventually(lambda: worker_count() == before, "the failed group's workers to be removed", 30)


def test_rank_zero_dispatch_refused_at_build():
    with pytest.raises(KeyError, match="Execute.RANK_ZERO"):
        WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(RankZeroDispatch))


def test_killed_worker_gives_worker_died_error():
    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Producer))
    try:
        with pytest.raises(WorkerDiedError) as info:
            wg.die()
        err = info.value
        assert err.rank == 1 and err.signal == signal.SIGKILL
        assert "SIGKILL" in str(err)
        with pytest.raises(WorkerDiedError):  # between calls too
            wg.info()
    finally:
        wg.shutdown()


def test_from_detached_second_group_object():
    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Producer),
                     name_prefix="det", detached=True)
    try:
        other = WorkerGroup.from_detached(worker_names=wg.worker_names, ray_cls_with_init=ClassWithInitArgs(Producer))
        assert [i["pid"] for i in other.info()] == [i["pid"] for i in wg.info()]
        by_prefix = WorkerGroup.from_detached(name_prefix="det", ray_cls_with_init=ClassWithInitArgs(Producer))
        assert by_prefix.world_size == 2
        other.shutdown()
        by_prefix.shutdown()
        assert wg.info()[1]["rank"] == 1
    finally:
        wg.shutdown()
        rt = get_runtime()
        rt.run(rt.scheduler.remove_workers([w.worker_id for w in wg.workers]))


class Waiter(Worker):
    """A method that finishes only once a file appears (proves blocking=False returns at once)."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def wait_for(self, data):
        path = data.meta_info["path"]
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        data.batch["a"] += self.rank
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def later(self, path):
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.rank


def test_non_blocking_returns_before_the_workers_finish(tmp_path):
    from podium.controller.session.futures import PendingRef
    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Waiter))
    try:
        gate = tmp_path / "gate"
        data = DataProto.from_dict(tensors={"a": torch.zeros(4, dtype=torch.long)}, meta_info={"path": str(gate)})
        # the workers block until the gate file exists: these calls must return without waiting
        future = wg.wait_for(data)
        refs = wg.later(str(gate))
        assert isinstance(future, DataProtoFuture) and all(isinstance(r, PendingRef) for r in refs)
        ready, not_ready = podium.wait(refs, num_returns=1, timeout=0.05)
        assert ready == [] and not_ready == refs
        gate.write_text("go")
        ready, not_ready = podium.wait(refs, num_returns=2, timeout=60)
        assert ready == refs and not_ready == []
        assert podium.get(refs) == [0, 1]
        assert podium.get(future).batch["a"].tolist() == [0, 0, 1, 1]
        # dropping the handles releases the results held in the workers
        rt = get_runtime()
        released = rt.stats["released"]
        del refs, future, ready, not_ready
        gc.collect()
        eventually(lambda: rt.stats["released"] >= released + 4, "the dropped refs to be released", 30)
    finally:
        wg.shutdown()


def test_fused_colocation_spawn_and_fuse():
    from podium.controller import create_colocated_worker_cls_fused
    cls = create_colocated_worker_cls_fused({"actor": ClassWithInitArgs(Actor), "critic": ClassWithInitArgs(Critic)})
    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), cls, name_prefix="fus")
    try:
        assert wg.worker_names == ["fusFusedWorker_actor_critic_0:0", "fusFusedWorker_actor_critic_0:1"]
        views = wg.spawn({"actor", "critic"})
        adds, subs = views["actor"].add(1), views["critic"].sub([5, 6])  # async role method works
        assert [v for v, _ in adds] == [1, 2] and [v for v, _ in subs] == [5, 5]
        assert [p for _, p in adds] == [p for _, p in subs]
        wg.fuse({"actor", "critic"})
        assert [v for v, _ in wg.actor.add(2)] == [2, 3]
    finally:
        wg.shutdown()


def test_split_pool_gives_disjoint_gpus():
    from podium.controller import split_resource_pool
    pool = ResourcePool([4], use_gpu=True, max_colocate_count=1)
    first, second = split_resource_pool(pool, 2)
    a = WorkerGroup(first, ClassWithInitArgs(Producer))
    b = WorkerGroup(second, ClassWithInitArgs(Producer))
    try:
        gpus_a = [i["env"]["CUDA_VISIBLE_DEVICES"] for i in a.info()]
        gpus_b = [i["env"]["CUDA_VISIBLE_DEVICES"] for i in b.info()]
        assert a.world_size == b.world_size == 2
        assert len(set(gpus_a + gpus_b)) == 4  # the pool is STRICT_PACK: one node, 4 GPUs
        assert [i["env"]["WORLD_SIZE"] for i in a.info()] == ["2", "2"]
    finally:
        a.shutdown()
        b.shutdown()
