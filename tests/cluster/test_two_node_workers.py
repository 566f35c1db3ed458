"""Worker processes on a real 2-node cluster, driven below the SDK (scheduler + worker clients).

A ``podium scheduler`` and two ``podium node`` agents (127.0.0.2 and 127.0.0.3, 2 fake GPUs
each) run as processes. One SPREAD placement group of 4 bundles lands 2 on each node; 4
workers, one per bundle, host a colocated actor+critic class defined in this module (so it
travels by value). The checks follow the node-agent issue's acceptance list: every env
variable each rank sees, a gloo all_reduce across the 4 ranks, a 100 MiB round trip, a
raised exception at the caller, both roles answering from one pid, a SIGKILLed worker
reported with its signal, and no process left once the agents stop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from podium import errors
from podium.scheduler.client import SchedulerClient
from podium.v1 import common_pb2
from podium.controller import ClassWithInitArgs, create_colocated_worker_cls
from podium.worker import Dispatch, Worker, register
from podium.worker.caller.client import WorkerClient
from tests.support.clusters import TWO_NODES, two_node_processes
from tests.support.proctable import alive

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

GROUP = "twonode"


class Actor(Worker):
    """The role that does the work: env, collectives, big tensors, errors."""

    def __init__(self, scale: int) -> None:
        super().__init__()
        self.scale = scale

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def environment(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "PODIUM_LOCAL_WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE", "WG_PREFIX",
                "WG_BACKEND", "PODIUM_NODE_ADDRESS", "EXTRA_FLAG")
        return {k: os.environ.get(k) for k in keys}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self) -> list:
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")  # from the env Podium set
        value = torch.tensor([float(self.rank + 1) * self.scale])
        dist.all_reduce(value)
        return value.tolist()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo_plus_one(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + 1

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail(self, text: str) -> None:
        raise KeyError(f"no such key: {text}")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class Critic(Worker):
    """A second role in the same process."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


def _workers_on_two_nodes(workdir):
    """The processes (2 fake GPUs per node), and 4 workers created through the scheduler."""
    with two_node_processes(workdir, gpus_per_node=2) as procs:
        async def create():
            async with SchedulerClient(procs.address, procs.token) as sched_client:
                deadline = time.monotonic() + 30
                while len((await sched_client.cluster_state()).nodes) < 2:
                    assert time.monotonic() < deadline, "the agents did not register"
                    await asyncio.sleep(0.1)
                pg = await sched_client.create_placement_group(
                    "twonode-pg", [{"CPU": 2, "GPU": 1}] * 4, "SPREAD")
                pg = await sched_client.wait_placement_group(pg.id, timeout=30)
                specs = [common_pb2.WorkerSpec(
                    name=f"{GROUP}:{i}", group=GROUP, placement_group_id=pg.id, bundle_index=i, num_gpus=1.0,
                    num_cpus=1.0, rank=i, world_size=4, env={"EXTRA_FLAG": f"flag-{i}"}) for i in range(4)]
                created = await sched_client.create_workers(specs, master_rank=0)
                return pg, await sched_client.wait_workers([w.id for w in created], timeout=60)

        pg, workers = asyncio.run(create())
        yield {"address": procs.address, "token": procs.token, "agents": procs.agents, "pg": pg,
               "workers": sorted(workers, key=lambda w: w.spec.rank)}


@pytest.fixture(scope="module")
def two_node_workers(tmp_path_factory):
    """Four workers on two node agents, shared by the tests of this module that leave them be."""
    yield from _workers_on_two_nodes(tmp_path_factory.mktemp("twonode"))


@pytest.fixture
def doomed_two_node_workers(tmp_path):
    """Four workers on two node agents of their own, for a test that kills them."""
    yield from _workers_on_two_nodes(tmp_path)


def _run_on_all(two_node_workers, body):
    """Connect a client to every worker, construct the colocated class once, run ``body``."""
    colocated = create_colocated_worker_cls({"actor": ClassWithInitArgs(Actor, scale=10),
                                             "critic": ClassWithInitArgs(Critic)})

    async def scenario():
        clients = [WorkerClient(f"{w.node_address}:{w.port}", two_node_workers["token"], rank=w.spec.rank,
                                worker_id=w.id) for w in two_node_workers["workers"]]
        try:
            descriptions = await asyncio.gather(*(c.start() for c in clients))
            pending = [c.construct(colocated, timeout=60) for c, d in zip(clients, descriptions)
                       if not d.constructed]
            await asyncio.gather(*pending)
            return await body(clients)
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    return asyncio.run(scenario())


def test_spread_puts_two_ranks_on_each_node_in_address_order(two_node_workers):
    nodes = [w.node_address for w in two_node_workers["workers"]]
    assert sorted(nodes) == sorted(TWO_NODES * 2)
    by_node = {n: [w.spec.rank for w in two_node_workers["workers"] if w.node_address == n] for n in TWO_NODES}
    assert all(len(ranks) == 2 for ranks in by_node.values())


def test_every_environment_variable_each_rank_sees(two_node_workers):
    async def body(clients):
        return await asyncio.gather(*(c.call("actor_environment") for c in clients))

    envs = _run_on_all(two_node_workers, body)
    workers = two_node_workers["workers"]
    placement = {p.bundle_index: p for p in two_node_workers["pg"].placements}
    master_addr = workers[0].node_address
    ports = {env["MASTER_PORT"] for env in envs}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for worker, env in zip(workers, envs):
        rank = worker.spec.rank
        bundle = placement[worker.spec.bundle_index]
        assert env == {
            "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": master_addr, "MASTER_PORT": env["MASTER_PORT"],
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, bundle.gpu_indices)), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1", "PODIUM_LOCAL_WORLD_SIZE": "2", "RAY_LOCAL_WORLD_SIZE": "2",
            "WG_PREFIX": GROUP, "WG_BACKEND": "podium", "PODIUM_NODE_ADDRESS": worker.node_address,
            "EXTRA_FLAG": f"flag-{rank}",
        }


def test_gloo_all_reduce_across_the_four_ranks(two_node_workers):
    async def body(clients):
        return await asyncio.gather(*(c.call("actor_all_reduce", timeout=120) for c in clients))

    # (1 + 2 + 3 + 4) * 10 on every rank.
    assert _run_on_all(two_node_workers, body) == [[100.0]] * 4


def test_a_100_mib_tensor_round_trip_is_bit_exact(two_node_workers):
    tensor = torch.randn(25 * 1024 * 1024)  # 100 MiB of float32
    view = tensor[::2]                       # non-contiguous on the way out

    async def body(clients):
        first = await clients[0].call("actor_echo_plus_one", (tensor,), timeout=120)
        remote = await clients[3].call("actor_echo_plus_one", (view,), timeout=120)
        return first, remote

    first, remote = _run_on_all(two_node_workers, body)
    assert torch.equal(first, tensor + 1)
    assert torch.equal(remote, view + 1)


def test_a_raised_exception_reaches_the_caller_with_its_traceback(two_node_workers):
    async def body(clients):
        with pytest.raises(errors.RemoteError) as info:
            await clients[2].call("actor_fail", ("alpha",))
        # The worker keeps serving after user code raised.
        return info.value, await clients[2].call("actor_pid")

    error, pid = _run_on_all(two_node_workers, body)
    assert error.rank == 2 and error.remote_type.endswith("KeyError")
    assert "no such key: alpha" in error.message
    # The traceback names this file, the method and its source line (the class went by value).
    assert __file__ in error.traceback and "in fail" in error.traceback
    assert 'raise KeyError(f"no such key: {text}")' in error.traceback
    assert pid > 0  # and the worker still answers


def test_colocated_roles_answer_from_one_pid(two_node_workers):
    async def body(clients):
        actor = await asyncio.gather(*(c.call("actor_pid") for c in clients))
        critic = await asyncio.gather(*(c.call("critic_pid") for c in clients))
        return actor, critic

    actor, critic = _run_on_all(two_node_workers, body)
    assert actor == critic and len(set(actor)) == 4


def test_sigkilled_worker_is_reported_with_its_signal_then_agents_leave_nothing(doomed_two_node_workers):
    two_node_workers = doomed_two_node_workers  # its own processes: it kills a worker and the agents
    victim = two_node_workers["workers"][1]
    pids = [w.pid for w in two_node_workers["workers"]]
    os.kill(victim.pid, signal.SIGKILL)

    async def reported():
        async with SchedulerClient(two_node_workers["address"], two_node_workers["token"]) as sched_client:
            deadline = time.monotonic() + 30.0
            while True:
                (info,) = await sched_client.get_workers(ids=[victim.id])
                if info.state in (common_pb2.WORKER_EXITED, common_pb2.WORKER_FAILED):
                    return info
                assert time.monotonic() < deadline, "the SIGKILL was never reported"
                await asyncio.sleep(0.02)

    info = asyncio.run(reported())
    assert info.exit.signal == signal.SIGKILL and "SIGKILL" in info.exit.reason

    for agent in two_node_workers["agents"].values():
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if alive(pid)]
        time.sleep(0.05)
