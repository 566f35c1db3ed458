"""A node agent killed with SIGKILL, and a whole node frozen (issue 7, item 3).

Killed and not started again: its fork server keeps the workers for a restarted agent to
re-adopt (``test_agent_restart.py``) until the node's fence deadline, then kills them, before
the scheduler marks the node dead once its lease (3 s here) runs out and reports the node's
workers EXITED; the
controller's next call on them raises WorkerDiedError naming the node; /v1/placement shows
the node dead, and new placement groups land on the live node only.

Frozen (agent and workers SIGSTOPped, as a machine that hangs or is cut off: no socket
closes): a call pending on its worker fails with WorkerDiedError soon after the node's
lease, through the controller's death watch, instead of waiting for the call's deadline.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

from tests.support.faultkit import (NODE_LEASE, FaultCluster, alive, elapsed, report,
                      wait_for)
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.errors import WorkerDiedError
from podium.v1 import common_pb2
from podium.worker import Dispatch, Worker, register

pytestmark = [pytest.mark.cluster, pytest.mark.faults, pytest.mark.timeout(240)]


class Where(Worker):
    """Says which node it runs on."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def node(self):
        import os
        return os.environ["PODIUM_NODE_ADDRESS"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        import os
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        time.sleep(seconds)
        return self.rank


def test_killed_agent_node_dead_workers_reported_dead_no_new_placement(scheduler_process, agents, token):
    fc = FaultCluster(scheduler_process, agents, token, ("127.0.0.2", "127.0.0.3"))
    rt = fc.connect(call_timeout=60)
    try:
        wg = WorkerGroup(ResourcePool([2, 2], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Where))
        assert wg.node() == ["127.0.0.2"] * 2 + ["127.0.0.3"] * 2
        pids = wg.pid()
        victim = fc.agents["127.0.0.3"]

        killed = time.monotonic()
        assert victim.signal(signal.SIGKILL) == -signal.SIGKILL
        def fenced() -> bool:
            # The node's state first: workers seen running *after* the scheduler declared the
            # node dead would be ranks that could live twice once placed elsewhere.
            dead = fc.node_state(victim.node_id) == "NODE_DEAD"
            running = alive(pids[2]) or alive(pids[3])
            assert not (dead and running), "the node was declared dead while its workers still ran"
            return not running

        wait_for(fenced, "the dead node's workers to be fenced", timeout=NODE_LEASE + 30)

        # The controller: the next call on the group names the first dead rank and its node.
        with pytest.raises(WorkerDiedError) as info:
            wg.node()
        seen = elapsed(killed)
        err = info.value
        report("node agent SIGKILL: call on its workers", seen, str(err))
        # (ranks 2 and 3 die together; the first whose death is confirmed is the error)
        assert err.rank in (2, 3) and err.node == victim.node_id and victim.node_id in str(err)

        # The scheduler: node dead after its lease, its workers EXITED naming it.
        wait_for(lambda: fc.node_state(victim.node_id) == "NODE_DEAD", "the node marked dead",
                 timeout=NODE_LEASE + 30)
        report(f"node agent SIGKILL: node DEAD in /v1/placement (lease {NODE_LEASE:g} s)", elapsed(killed),
               "NODE_DEAD")
        state = rt.run(rt.cluster_state())
        for w in state.workers:
            if w.node_id == victim.node_id:
                assert w.state in (common_pb2.WORKER_EXITED, common_pb2.WORKER_FAILED)
                assert victim.node_id in w.exit.reason, w.exit.reason
        # The live node's ranks still answer.
        assert [wg.workers[r].call("node") for r in (0, 1)] == ["127.0.0.2"] * 2
        wg.shutdown()
        wait_for(lambda: fc.busy() == ([], []), "every slot free after teardown")

        # New placement groups go to the live node only; the dead node holds nothing.
        again = WorkerGroup(ResourcePool([2], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Where))
        assert again.node() == ["127.0.0.2"] * 2
        view = fc.placement()
        dead = next(n for n in view["nodes"] if n["node_id"] == victim.node_id)
        assert dead["state"] == "NODE_DEAD"
        assert all(not g["bundles"] and not g["workers"] for g in dead["gpus"])
        for group in view["placement_groups"]:
            assert all(b["node_id"] != victim.node_id for b in group["bundles"])
        again.shutdown()
    finally:
        fc.close()


def test_frozen_node_fails_pending_calls_after_its_lease(scheduler_process, agents, token):
    fc = FaultCluster(scheduler_process, agents, token, ("127.0.0.2", "127.0.0.3"))
    fc.connect(call_timeout=300)
    frozen: list[int] = []
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        wg = WorkerGroup(ResourcePool([2, 2], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Where))
        assert wg.node() == ["127.0.0.2"] * 2 + ["127.0.0.3"] * 2
        pids = wg.pid()
        node = fc.agents["127.0.0.3"]
        call = pool.submit(wg.nap, 120)  # would hold the caller for two minutes
        time.sleep(0.5)
        frozen[:] = [node.proc.pid, pids[2], pids[3]]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        err = call.exception(timeout=NODE_LEASE + 30)
        seen = elapsed(stopped)
        assert isinstance(err, WorkerDiedError), repr(err)
        report(f"node frozen (SIGSTOP agent + workers; lease {NODE_LEASE:g} s): pending call", seen, str(err))
        assert err.rank in (2, 3) and err.node == node.node_id and f"node {node.node_id} died" in str(err)
        assert fc.node_state(node.node_id) == "NODE_DEAD"
        # Its workers are dead for this controller from now on: a call fails at once.
        with pytest.raises(WorkerDiedError):
            wg.workers[3].call("pid")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)  # the agent re-registers and stops its stale workers
        fc.close()  # (stops the live node's workers, so the naps there end too)
        pool.shutdown(wait=True)
