"""A controller that disappears without cleaning up (issue 7, item 5).

A controller script (a subprocess, session lease 3 s) builds one ordinary WorkerGroup and one
detached WorkerGroup on a detached pool, then is SIGKILLed. After the lease the scheduler
reclaims the ordinary group's workers and placement group; the detached ones survive, and a
new controller (this process) attaches with ``WorkerGroup.from_detached`` and calls them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support.faultkit import (SESSION_LEASE, FaultCluster, alive, elapsed, report,
                      wait_for)
from podium.controller import ClassWithInitArgs, WorkerGroup
from podium.worker import Dispatch, Worker, register

pytestmark = [pytest.mark.cluster, pytest.mark.faults, pytest.mark.timeout(240)]

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import podium
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.worker import Dispatch, Worker, register

    class Keeper(Worker):
        def __init__(self):
            super().__init__()
            self.value = 0

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def put(self, value):
            self.value = value
            return os.getpid()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def value_of(self):
            return self.value

    podium.init(address=sys.argv[1], call_timeout=60, session_lease=float(sys.argv[2]))
    plain = WorkerGroup(ResourcePool([1], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Keeper))
    kept = WorkerGroup(ResourcePool([1], use_gpu=True, max_colocate_count=1, detached=True),
                       ClassWithInitArgs(Keeper), name_prefix="kept", detached=True)
    print(json.dumps({"plain": plain.put(1), "kept": kept.put(42),
                      "plain_pgs": [pg.id for pg in plain.resource_pool.pgs],
                      "kept_pgs": [pg.id for pg in kept.resource_pool.pgs]}), flush=True)
    time.sleep(600)
""")


class Keeper(Worker):
    """The script's class, for binding its methods onto the attached group."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def put(self, value):  # pragma: no cover - runs in the worker
        ...

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def value_of(self):  # pragma: no cover - runs in the worker
        ...


def test_vanished_controller_reclaimed_after_lease_detached_survive(scheduler_process, agents, token, tmp_path):
    fc = FaultCluster(scheduler_process, agents, token, ("127.0.0.2",))
    script = tmp_path / "controller.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PODIUM_TOKEN=token)
    log = open(tmp_path / "controller.err", "wb")
    proc = subprocess.Popen([sys.executable, str(script), fc.scheduler.address, str(SESSION_LEASE)],
                            env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the groups exist (the test's timeout bounds it)
        assert line, (tmp_path / "controller.err").read_text()[-3000:]
        made = json.loads(line)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        gone = time.monotonic()

        def reclaimed():
            groups, workers = fc.busy()
            live_pgs = {g["id"] for g in groups}
            # A stopped worker holds its slot until its agent confirms the stop.
            return (not any(alive(pid) for pid in made["plain"])
                    and not live_pgs & set(made["plain_pgs"])
                    and not {w["pid"] for w in workers} & set(made["plain"]))

        wait_for(reclaimed, "the vanished controller's workers and placement group reclaimed",
                 timeout=SESSION_LEASE + 30)
        report(f"controller SIGKILL: its workers and placement groups reclaimed (session lease "
               f"{SESSION_LEASE:g} s)", elapsed(gone), "workers stopped, placement group removed")

        # The detached group is untouched: its worker, its state, its placement group.
        groups, workers = fc.busy()
        assert {g["id"] for g in groups} == set(made["kept_pgs"])
        assert [w["pid"] for w in workers] == made["kept"] and all(alive(p) for p in made["kept"])

        # A new controller attaches by name and calls it.
        rt = fc.connect(call_timeout=60)
        attached = WorkerGroup.from_detached(name_prefix="kept", ray_cls_with_init=ClassWithInitArgs(Keeper))
        assert attached.value_of() == [42]
        attached.shutdown()  # an attached group only disconnects
        assert all(alive(p) for p in made["kept"])
        # Clean up what detached means nobody else will.
        rt.run(rt.scheduler.remove_workers([w.worker_id for w in attached.workers]))
        for pg in made["kept_pgs"]:
            rt.run(rt.scheduler.remove_placement_group(pg))
        wait_for(lambda: fc.busy() == ([], []), "the detached group removed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
        fc.close()
