"""Podium across a real network: nodes in their own network namespaces, and partitions.

The scheduler and two node agents each run in a namespace of their own on one bridge
(``tests/support/netlab.py``), with private ``/dev/shm`` mounts; this test process, the
controller, reaches them through its own link. Nothing crosses loopback or shared memory.

A partition takes a node's link down: packets are dropped and no socket is closed, so
neither side learns of it from the kernel, as when a cable or switch port fails.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time

import pytest
import torch

import podium
from podium import DataProto
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.errors import PodiumError
from podium.worker import Dispatch, Worker, register
from tests.support.faultkit import NODE_LEASE, SCHEDULER_FLAGS, OWN_SESSION_LEASE, http_json, report
from tests.support.netlab import NetLab, unavailable
from tests.support.processes import AgentProcess, SchedulerProcess
from tests.support.proctable import alive
from tests.support.waiting import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.faults, pytest.mark.netns, pytest.mark.timeout(300)]

WHY_NOT = unavailable()
if WHY_NOT:
    pytest.skip(f"no network namespaces here: {WHY_NOT}", allow_module_level=True)


class Where(Worker):
    """Says where it runs; naps; adds one to a batch."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def node(self):
        import os
        return os.environ["PODIUM_NODE_ADDRESS"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def bump(self, data):
        data.batch["x"] += 1
        return data


class NetCluster:
    """A scheduler and node agents on lab hosts, and this process connected as controller."""

    def __init__(self, lab: NetLab, tmp_path, token: str, nodes: tuple[str, ...],
                 gpus: dict[str, int] | None = None) -> None:
        self.lab, self.token = lab, token
        host = lab.add_host("sched")
        self.scheduler = SchedulerProcess(tmp_path / "scheduler.db", token, tmp_path, *SCHEDULER_FLAGS,
                                          host=host.address, launch=functools.partial(lab.popen, host)).start()
        self.hosts = {name: lab.add_host(name) for name in nodes}
        self.agents = {name: AgentProcess(tmp_path, self.scheduler.address, h.address, token, "--cpus", "8",
                                          *(("--fake-gpus", str(gpus[name])) if gpus and name in gpus else ()),
                                          launch=functools.partial(lab.popen, h))
                       for name, h in self.hosts.items()}
        for name, agent in self.agents.items():
            eventually(lambda agent=agent: self.node_state(agent.node_id) == "NODE_ALIVE", f"node {name} alive")
        podium.init(address=self.scheduler.address, token=token, call_timeout=120,
                    session_lease=OWN_SESSION_LEASE)

    def node_state(self, node_id: str) -> str:
        """NODE_ALIVE / NODE_DEAD / '' as the scheduler's /v1/placement shows it."""
        for node in http_json(self.scheduler.http_url + "/v1/placement", self.token)["nodes"]:
            if node["node_id"] == node_id:
                return node["state"]
        return ""

    def close(self) -> None:
        podium.shutdown()
        for agent in self.agents.values():
            if agent.proc.poll() is None:
                agent.signal(15)
        self.scheduler.kill(15)


@pytest.fixture
def net(tmp_path, token):
    with NetLab() as lab:
        cluster = NetCluster(lab, tmp_path, token, ("a", "b"))
        try:
            yield cluster
        finally:
            cluster.close()


def batch(rows: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024)})


def test_nodes_on_a_real_network_are_remote_hosts(net):
    wg = WorkerGroup(ResourcePool([2, 2], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Where))
    assert wg.node() == [net.hosts["a"].address] * 2 + [net.hosts["b"].address] * 2
    # Each node has its own /dev/shm: Podium sends over TCP, not through shared memory.
    assert [w.client.same_host for w in wg.workers] == [False] * 4
    data = batch(4096)  # 16 MiB
    out = wg.bump(data)
    assert torch.equal(out.batch["x"], data.batch["x"] + 1)


def test_a_partition_shorter_than_the_lease_loses_nothing(net):
    wg = WorkerGroup(ResourcePool([2, 2], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Where))
    b = net.hosts["b"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(wg.nap, 2.0)
        time.sleep(0.3)  # the fault lands while the call runs; any moment in it will do
        net.lab.cut(b)
        time.sleep(NODE_LEASE / 3)
        net.lab.heal(b)
        assert pending.result(timeout=120) == [0, 1, 2, 3]
    assert net.node_state(net.agents["b"].node_id) == "NODE_ALIVE"
    assert wg.nap(0) == [0, 1, 2, 3]


def test_a_partition_longer_than_the_lease_fails_calls_on_the_cut_node_only(net):
    spread = WorkerGroup(ResourcePool([2, 2], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Where), name_prefix="spread")
    local = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Where), name_prefix="local")
    assert local.node() == [net.hosts["a"].address]
    b, node_b = net.hosts["b"], net.agents["b"].node_id
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(spread.nap, 30.0)
        time.sleep(0.3)
        cut = time.monotonic()
        net.lab.cut(b)
        with pytest.raises(PodiumError) as info:
            pending.result(timeout=120)
    report("partition > lease: pending call on the cut node", time.monotonic() - cut, str(info.value))
    assert node_b in str(info.value) or b.address in str(info.value), info.value
    cut_pids = [w.pid for w in spread.workers[2:]]
    eventually(lambda: net.node_state(node_b) == "NODE_DEAD", "the cut node marked dead", NODE_LEASE + 30)
    # Fenced: by the time the scheduler may place the cut node's ranks elsewhere, their
    # processes there are gone (the agent, unable to renew its lease, killed them).
    assert not any(alive(pid) for pid in cut_pids), "a cut node's worker outlived its node's lease"
    report("partition > lease: cut node's workers fenced", time.monotonic() - cut, "before NODE_DEAD")
    # The other node's group never noticed.
    assert local.nap(0) == [0]
    assert local.node() == [net.hosts["a"].address]
    # Healed, the node rejoins clean: alive, with none of its old workers.
    net.lab.heal(b)
    eventually(lambda: net.node_state(node_b) == "NODE_ALIVE", "the healed node to rejoin")
    assert not any(alive(pid) for pid in cut_pids)
    assert local.nap(0) == [0]

