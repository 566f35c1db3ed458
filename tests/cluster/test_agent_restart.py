"""A node agent SIGKILLed and started again mid-job re-adopts its workers (issue 31, item 3).

The workers are the fork server's children, not the agent's, so they outlive it; the agent
started again on the same node, port and log folder connects to that fork server, takes the
workers over before it registers, and the scheduler hears of them as running. The job's
calls go straight to the workers and never notice. What the restarted agent adopted it also
reaps: a worker killed afterwards is reported EXITED with its signal, and the next call on it
raises WorkerDiedError.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.support.faultkit import FaultCluster, alive, report, wait_for
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.errors import WorkerDiedError
from podium.v1 import common_pb2
from podium.worker import Dispatch, Worker, register

pytestmark = [pytest.mark.cluster, pytest.mark.faults, pytest.mark.timeout(240)]

HOST = "127.0.0.2"


class Echo(Worker):
    """Echoes a payload and says who it is."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        import os
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo(self, data):
        return data


class Caller(threading.Thread):
    """Calls the group back to back until stopped, counting what came back and what failed."""

    def __init__(self, wg: WorkerGroup) -> None:
        super().__init__(daemon=True)
        self.wg = wg
        self.done = threading.Event()
        self.calls = 0
        self.failures: list[BaseException] = []

    def run(self) -> None:
        payload = bytes(range(256)) * 256
        while not self.done.is_set():
            try:
                assert self.wg.echo(payload) == [payload] * self.wg.world_size
                self.calls += 1
            except BaseException as exc:  # noqa: BLE001 - every failure is what the test counts
                self.failures.append(exc)


def restart(fc: FaultCluster, agents, old) -> object:
    """Start the node's agent again on the same host, port and log folder."""
    old.port_file.unlink()  # the new agent writes its own
    again = agents(fc.scheduler.address, HOST, "--cpus", "8", "--port", str(old.port), *fc.agent_flags)
    fc.agents[HOST] = again
    return again


def workers_of(rt, node_id: str) -> dict[str, common_pb2.WorkerInfo]:
    return {w.id: w for w in rt.run(rt.cluster_state()).workers if w.node_id == node_id}


def test_a_restarted_agent_readopts_its_workers_and_the_job_never_notices(scheduler_process, agents, token):
    fc = FaultCluster(scheduler_process, agents, token, (HOST,))
    rt = fc.connect(call_timeout=60)
    try:
        wg = WorkerGroup(ResourcePool([2], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Echo))
        pids = wg.pid()
        victim = fc.agents[HOST]
        before = workers_of(rt, victim.node_id)
        caller = Caller(wg)
        caller.start()
        wait_for(lambda: caller.calls >= 5, "calls flowing")

        assert victim.signal(signal.SIGKILL) == -signal.SIGKILL
        at_kill = caller.calls
        assert all(alive(pid) for pid in pids)  # the agent took no worker with it
        again = restart(fc, agents, victim)
        assert again.node_id == victim.node_id

        # The new agent registered them as running: same ids, same pids, nothing ended.
        wait_for(lambda: fc.node_state(again.node_id) == "NODE_ALIVE", "the node alive again")
        log = again.port_file.parent / f"agent-{HOST}.log"
        wait_for(lambda: "re-adopted 2 running worker(s)" in log.read_text(), "the agent to re-adopt")
        wait_for(lambda: caller.calls >= at_kill + 20, "calls after the restart")
        caller.done.set()
        caller.join(timeout=60)
        assert not caller.failures, caller.failures[:3]
        after = workers_of(rt, again.node_id)
        assert {i: (w.pid, w.state) for i, w in after.items()} == {
            i: (w.pid, common_pb2.WORKER_RUNNING) for i, w in before.items()}
        assert wg.pid() == pids
        report("node agent SIGKILL and restart: job calls failed", 0.0,
               f"0 of {caller.calls} calls failed; {len(after)} workers re-adopted")

        # The restarted agent reaps what it adopted: a worker killed now is reported with its signal.
        victim_id = next(i for i, w in after.items() if w.pid == pids[1])
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: workers_of(rt, again.node_id)[victim_id].state == common_pb2.WORKER_EXITED,
                 "the adopted worker's death reported")
        ended = workers_of(rt, again.node_id)[victim_id]
        assert ended.exit.signal == signal.SIGKILL, ended.exit
        with pytest.raises(WorkerDiedError) as info:
            wg.pid()
        assert info.value.rank == 1
        wg.shutdown()
        wait_for(lambda: fc.busy() == ([], []), "every slot free after teardown")
        wait_for(lambda: not alive(pids[0]), "the group's processes gone")
    finally:
        fc.close()
