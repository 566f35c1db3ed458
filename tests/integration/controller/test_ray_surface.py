"""Issue 17's Ray surface on real clusters: put, remote functions, single actors, handle
lifetime and name_prefix duplicates, each on the embedded cluster and on two loopback nodes
(a scheduler and two node agents as processes, 127.0.0.2 and 127.0.0.3)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time

import pytest
import torch

import podium
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.controller.session.runtime import get_runtime
from podium.dataproto import DataProto
from podium.errors import (AlreadyExistsError, InvalidArgumentError, NotFoundError, ObjectLostError,
                           RemoteError, WorkerDiedError)
from podium.refs import DataProtoFuture
from podium.v1 import common_pb2
from podium.worker import Dispatch, Worker, register
from tests.support.clusters import controller_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", params=["embedded", "two_nodes"])
def cluster(request, tmp_path_factory):
    with controller_cluster(request.param, tmp_path_factory.mktemp("cluster"), gpus_per_node=2):
        yield request.param


def live_workers(prefix: str = "") -> list:
    rt = get_runtime()
    state = rt.run(rt.cluster_state())
    return [w for w in state.workers if w.state in (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING)
            and w.spec.name.startswith(prefix)]


def eventually(predicate, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, what
        gc.collect()
        time.sleep(0.1)


class Reader(Worker):
    """Reads what it is given (put refs arrive as values)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def total(self, t):
        return float(t.sum()), os.environ["PODIUM_NODE_ADDRESS"]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data):
        return DataProto.from_dict(tensors={"x": data.batch["x"] * 2})


class Other(Worker):
    """A second class for the name_prefix test."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def kind(self):
        return "other"


@podium.remote
class Counter:
    """An actor that owns a counter."""

    def __init__(self, start: int = 0):
        self.n = start
        self.kept = None

    def incr(self, k: int = 1) -> int:
        self.n += k
        return self.n

    def keep(self, value):
        self.kept = podium.put(value)  # held by this worker while it keeps the ref
        return self.kept

    def where(self) -> str:
        return os.environ["PODIUM_NODE_ADDRESS"]

    def fail(self):
        raise KeyError("no such key")


@podium.remote
class Rendezvous:
    """Two calls that can only both finish when they run at the same time."""

    def __init__(self):
        self.event = None

    async def wait_for_peer(self) -> str:
        self.event = self.event or asyncio.Event()
        await asyncio.wait_for(self.event.wait(), 30)
        return "woken"

    async def wake(self) -> str:
        self.event = self.event or asyncio.Event()
        self.event.set()
        return "woke"


class Threads:
    """A sync actor; two calls meet at a barrier only when they run in two threads."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=30)

    def meet(self, i: int) -> int:
        self.barrier.wait()
        return i


@podium.remote(num_cpus=1)
def square(x):
    return x * x


@podium.remote
def add(a, b):
    return a + b


@podium.remote
async def async_echo(x):
    await asyncio.sleep(0)
    return x


# ---- put ---------------------------------------------------------------------------------


def test_put_get_and_wait(cluster):
    small, big = podium.put({"a": 1}), podium.put(torch.arange(1 << 19))
    assert podium.get(small) == {"a": 1}
    assert torch.equal(podium.get(big), torch.arange(1 << 19))
    ready, not_ready = podium.wait([small, big], num_returns=2, timeout=30)
    assert ready == [small, big] and not_ready == []
    with pytest.raises(InvalidArgumentError):
        podium.put(small)


def test_put_values_reach_group_workers_and_futures(cluster):
    wg = WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(Reader))
    try:
        ref = podium.put(torch.ones(1 << 20))
        assert [t for t, _ in wg.total(ref)] == [float(1 << 20)] * 2
        data = DataProto.from_dict(tensors={"x": torch.arange(8)})
        future = DataProtoFuture([podium.put(data)])
        out = wg.double(future)
        assert torch.equal(out.batch["x"], torch.arange(8) * 2)
        assert torch.equal(future.slice(2, 4).get().batch["x"], torch.arange(2, 4))
    finally:
        wg.shutdown()


def test_put_is_released_when_dropped(cluster):
    held = get_runtime().objects
    ref = podium.put(torch.zeros(1000))
    object_id = ref.object_id
    assert held.store.holds(object_id)
    del ref
    # By id, not by count: an earlier test's put may be released meanwhile too.
    eventually(lambda: not held.store.holds(object_id), "the dropped put was not released")


def test_put_in_a_worker_and_lost_owner(cluster):
    actor = Counter.remote()
    ref = podium.get(actor.keep.remote([1, 2, 3]))
    assert podium.get(ref) == [1, 2, 3]
    assert podium.get(add.remote(ref, [4])) == [1, 2, 3, 4]  # a task reads it from the actor
    podium.kill(actor)
    with pytest.raises(ObjectLostError, match=ref.worker_id):
        podium.get(ref)


# ---- remote functions --------------------------------------------------------------------


def test_task_fan_out_errors_and_async(cluster):
    refs = [square.remote(i) for i in range(16)]
    assert podium.get(refs) == [i * i for i in range(16)]
    assert podium.get(add.remote(square.remote(3), 1)) == 10  # a pending ref as argument
    assert podium.get(async_echo.remote("x")) == "x"
    assert podium.get(square.options(num_cpus=2).remote(5)) == 25

    @podium.remote
    def broken():
        raise ValueError("task failed here")

    with pytest.raises(RemoteError, match="task failed here") as info:
        podium.get(broken.remote())
    assert "Remote traceback" in str(info.value)
    with pytest.raises(TypeError):
        square(2)


@podium.remote(num_cpus=0.5)
def task_pid(_seq):
    return os.getpid()


def test_a_dead_task_worker_leaves_its_pool_and_later_tasks_run(cluster):
    pids = set(podium.get([task_pid.remote(i) for i in range(8)]))
    victim = sorted(pids)[0]
    os.kill(victim, signal.SIGKILL)
    failures = []
    # A task that meets the dead worker runs again on another (Ray's default max_retries=3);
    # its pool starts a fresh worker in its place.
    for i in range(40):
        try:
            pid = podium.get(task_pid.remote(i), timeout=60)
        except WorkerDiedError as exc:
            failures.append(exc)
            continue
        assert pid != victim
    assert not failures, failures
    assert set(podium.get([task_pid.remote(i) for i in range(8)])).isdisjoint({victim})


# ---- actors ------------------------------------------------------------------------------


def test_actor_counter_and_errors(cluster):
    counter = Counter.remote(10)
    assert podium.get([counter.incr.remote(), counter.incr.remote(5)]) == [11, 16]
    with pytest.raises(RemoteError, match="no such key"):
        podium.get(counter.fail.remote())
    assert podium.get(counter.incr.remote()) == 17  # the actor keeps serving
    with pytest.raises(TypeError):
        Counter()


def test_async_methods_run_concurrently(cluster):
    actor = Rendezvous.remote()
    waiting = actor.wait_for_peer.remote()
    assert podium.get(actor.wake.remote()) == "woke"
    assert podium.get(waiting, timeout=60) == "woken"


def test_max_concurrency_runs_sync_methods_in_threads(cluster):
    actor = podium.remote(Threads).options(max_concurrency=2).remote()
    assert podium.get([actor.meet.remote(1), actor.meet.remote(2)], timeout=60) == [1, 2]


def test_named_actor_lookup_kill_and_died_error(cluster):
    named = Counter.options(name="the-counter", namespace="tests", num_cpus=0.5).remote()
    found = podium.get_actor("the-counter", namespace="tests")
    assert podium.get(found.incr.remote(3)) == 3
    assert podium.get(named.incr.remote()) == 4  # one actor, two handles
    with pytest.raises(AlreadyExistsError):
        Counter.options(name="the-counter", namespace="tests").remote()
    same = Counter.options(name="the-counter", namespace="tests", get_if_exists=True).remote()
    assert podium.get(same.incr.remote()) == 5
    podium.kill(found)
    with pytest.raises(WorkerDiedError):
        podium.get(named.incr.remote())
    with pytest.raises(NotFoundError):
        podium.get_actor("the-counter", namespace="tests")


def test_actor_in_a_placement_group_bundle(cluster):
    from podium.controller import PlacementGroupSchedulingStrategy
    from podium.controller.remote.placement import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD" if cluster == "two_nodes" else "PACK")
    assert podium.get(pg.ready(), timeout=60) is True
    places = {p.bundle_index: p.node_address for p in get_runtime().run(
        get_runtime().scheduler.get_placement_group(pg.id)).placements}
    actors = [Counter.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
              for i in range(2)]
    assert podium.get([a.where.remote() for a in actors]) == [places[0], places[1]]
    remove_placement_group(pg)
    with pytest.raises(WorkerDiedError):
        podium.get(actors[0].incr.remote())


def test_bad_actor_options(cluster):
    with pytest.raises(InvalidArgumentError):
        Counter.options(num_cpus=-1)
    with pytest.raises(InvalidArgumentError):
        Counter.options(max_concurrency=0)
    with pytest.raises(InvalidArgumentError):
        Counter.options(colour="red")
    with pytest.raises(InvalidArgumentError, match="num_returns is an option of tasks and actor methods"):
        Counter.options(num_returns=2)


# ---- lifetime ----------------------------------------------------------------------------


def test_dropping_a_group_and_its_views_stops_its_workers(cluster):
    from podium.controller import create_colocated_worker_cls

    cls = create_colocated_worker_cls({"reader": ClassWithInitArgs(Reader), "other": ClassWithInitArgs(Other)})
    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=2), cls, name_prefix="life")
    view = wg.spawn({"reader", "other"})["reader"]
    assert len(live_workers("life")) == 2
    del wg
    gc.collect()
    time.sleep(0.5)
    assert len(live_workers("life")) == 2  # the spawned view keeps them
    assert [t for t, _ in view.total(torch.ones(3))] == [3.0, 3.0]
    del view
    eventually(lambda: not live_workers("life"), "the group's workers outlived their last reference")


def test_a_copy_of_a_group_keeps_its_workers(cluster):
    wg = WorkerGroup(ResourcePool([1], use_gpu=False), ClassWithInitArgs(Reader), name_prefix="copied")
    other = __import__("copy").copy(wg)
    del wg
    gc.collect()
    time.sleep(0.5)
    assert other.total(torch.ones(2))[0][0] == 2.0
    other.shutdown()  # the explicit way still works, and the collection that follows is a no-op
    assert not live_workers("copied")


def test_dropping_an_actor_handle_frees_its_slot(cluster):
    handle = Counter.options(name="dropped").remote()
    copy = __import__("copy").copy(handle)
    del handle
    gc.collect()
    assert podium.get(copy.incr.remote()) == 1  # a second reference keeps it
    name = copy.worker.name
    del copy
    eventually(lambda: not live_workers(name), "the actor outlived its last handle")
    with pytest.raises(NotFoundError):
        podium.get_actor("dropped")


def test_dropping_a_restartable_actors_handle_stops_it_for_good(cluster):
    handle = Counter.options(name="phoenix-dropped", max_restarts=-1).remote()
    assert podium.get(handle.incr.remote()) == 1
    name = handle.worker.name
    del handle
    gc.collect()
    eventually(lambda: not live_workers(name), "the restartable actor outlived its last handle")
    time.sleep(1.0)  # a restart would have placed a new worker by now
    assert not live_workers(name)


def test_detached_actor_survives_its_handle(cluster):
    handle = Counter.options(name="kept", lifetime="detached").remote()
    name = handle.worker.name
    del handle
    gc.collect()
    time.sleep(0.5)
    assert live_workers(name)
    found = podium.get_actor("kept")
    assert podium.get(found.incr.remote()) == 1
    podium.kill(found)


def test_name_prefix_duplicates_across_classes(cluster):
    a = WorkerGroup(ResourcePool([1], use_gpu=False), ClassWithInitArgs(Reader), name_prefix="same")
    b = WorkerGroup(ResourcePool([1], use_gpu=False), ClassWithInitArgs(Other), name_prefix="same")
    try:
        assert a.total(torch.ones(2))[0][0] == 2.0
        assert b.kind() == ["other"]
    finally:
        a.shutdown()
        b.shutdown()


def test_node_affinity(cluster):
    from podium.controller import NodeAffinitySchedulingStrategy
    from podium.errors import InfeasibleError

    rt = get_runtime()
    nodes = sorted((n.info.address, n.info.node_id) for n in rt.run(rt.cluster_state()).nodes)
    address, node_id = nodes[-1]  # the second node of two, or the only one
    by_id = Counter.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id)).remote()
    by_address = Counter.options(node=address).remote()
    assert podium.get([by_id.where.remote(), by_address.where.remote()]) == [address, address]
    assert podium.get(square.options(node=address).remote(4)) == 16
    with pytest.raises(InfeasibleError, match="10.9.9.9"):
        Counter.options(scheduling_strategy=NodeAffinitySchedulingStrategy("10.9.9.9")).remote()
    soft = Counter.options(scheduling_strategy=NodeAffinitySchedulingStrategy("10.9.9.9", soft=True)).remote()
    assert podium.get(soft.where.remote()) in {a for a, _ in nodes}


def test_the_object_server_runs_no_calls(cluster, arun):
    from podium import errors
    from podium.worker.caller.client import WorkerClient

    podium.put(1)  # the object server is up
    rt = get_runtime()
    address = rt.objects.address

    async def call():
        client = WorkerClient(address, rt.token)
        try:
            await client.start(timeout=10)
            await client.call("anything", (), timeout=10)
        finally:
            await client.close()

    # The stream is refused (how the client words it depends on when it notices).
    with pytest.raises(errors.PodiumError):
        arun(call(), timeout=60)
    assert rt.objects.store.stats["calls"] == 0
