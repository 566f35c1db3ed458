"""Issue 51 item 5, the partition case: a rank's node is partitioned away mid-step (its link
down, packets dropped, no socket closed), the group replaces the rank from its warm standby
on another node, every rank re-forms gloo on the new rendezvous's Podium store over the lab
network, and training continues with exactly the parameters of the undisturbed run.

Nodes (``tests/support/netlab.py``): ``a`` with 3 (fake) GPUs holds ranks 0-2, ``b`` and
``c`` with 1 each hold rank 3 and the standby (either way round); the victim's node is cut.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time

import pytest

from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.errors import PodiumError
from podium.worker import Dispatch, register
from tests.support.faultkit import NODE_LEASE, report
from tests.support.netlab import NetLab, unavailable
from tests.support.proctable import alive
from tests.support.waiting import eventually

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.cluster, pytest.mark.faults, pytest.mark.netns, pytest.mark.timeout(600)]

WHY_NOT = unavailable()
if WHY_NOT:
    pytest.skip(f"no network namespaces here: {WHY_NOT}", allow_module_level=True)

from tests.cluster.test_network_partitions import NetCluster  # noqa: E402  (after the skip)
from tests.support.glootrainer import GlooTrainer  # noqa: E402  (it imports torch)

STEPS = 5
BROKEN_STEP = 2
VICTIM = 3
#: gloo's timeout: how long a survivor waits in all_reduce for the cut rank.
GLOO_TIMEOUT_S = 10


class NetTrainer(GlooTrainer):
    """The shared gloo trainer over the lab network, on the Podium store of each rendezvous."""

    podium_store = True
    gloo_timeout_s = GLOO_TIMEOUT_S

    def __init__(self):
        # gloo binds the address of this interface: the host's one link (not loopback).
        os.environ["GLOO_SOCKET_IFNAME"] = next(n for _, n in socket.if_nameindex() if n != "lo")
        super().__init__()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self):
        return os.environ["PODIUM_NODE_ADDRESS"], os.getpid(), self.hooks


@pytest.fixture
def net(tmp_path, token):
    with NetLab() as lab:
        cluster = NetCluster(lab, tmp_path, token, ("a", "b", "c"), gpus={"a": 3, "b": 1, "c": 1})
        try:
            yield cluster
        finally:
            cluster.close()


def test_a_partitioned_rank_is_replaced_and_training_matches_bit_for_bit(net):
    wg = WorkerGroup(ResourcePool([3, 1], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(NetTrainer),
                     standby=1, on_rank_death="replace")
    try:
        assert wg.form() == [0, 1, 2, 3]
        where = wg.where()
        a = net.hosts["a"].address
        assert [w[0] for w in where[:3]] == [a] * 3 and where[3][0] != a
        victim_host = next(h for h in net.hosts.values() if h.address == where[3][0])
        standby = wg.standby_workers[0]
        assert standby.node_address not in (a, victim_host.address)

        wg.reset()
        for s in range(STEPS):
            wg.step(s)
        reference = wg.params()

        wg.reset()
        for s in range(BROKEN_STEP):
            wg.step(s)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(wg.step, BROKEN_STEP, VICTIM)
            time.sleep(1.0)  # every rank is inside the step, the victim in its stall
            cut = time.monotonic()
            net.lab.cut(victim_host)
            with pytest.raises(PodiumError) as info:
                pending.result(timeout=300)
        report("partition of a rank's node: the step fails", time.monotonic() - cut, str(info.value))
        assert victim_host.address in str(info.value) or net.agents[victim_host.name].node_id in str(info.value)
        for s in range(BROKEN_STEP, STEPS):  # the first call replaces the rank, then replays the step
            wg.step(s)
        report("partition of a rank's node: replaced, lost step replayed", time.monotonic() - cut,
               f"timings {wg.last_replacement}")
        after = wg.params()
        for ref_rank, got_rank in zip(reference, after):
            for x, y in zip(ref_rank, got_rank):
                assert torch.equal(x, y)
        assert wg.workers[VICTIM].worker_id == standby.worker_id and wg.rendezvous_version >= 1
        now = wg.where()
        assert now[VICTIM][0] == standby.node_address
        assert all(w[2] and w[2][-1] == wg.rendezvous_version for w in now)
        # Fenced: the cut node's rank is gone (its agent, unable to renew its lease, killed it),
        # and a healed link brings nothing back.
        eventually(lambda: not alive(where[3][1]), "the cut rank's process to end", NODE_LEASE + 60)
        net.lab.heal(victim_host)
        eventually(lambda: net.node_state(net.agents[victim_host.name].node_id) == "NODE_ALIVE",
                   "the healed node to rejoin")
        assert not alive(where[3][1])
        assert [w[1] for w in wg.where()] == [w[1] for w in now]
    finally:
        wg.shutdown()
