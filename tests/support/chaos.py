"""A chaos soak: the job of :mod:`tests.support.chaosjob` on namespaced nodes, through
random faults, with the counts at the end (issue #31, item 6).

The cluster is a :class:`~tests.support.netlab.NetLab`: the scheduler and each node agent
(with its workers) in a network namespace of its own with a private ``/dev/shm``, this
process the controller on its own link. :class:`Soak` picks faults with a seeded random
generator, ``per_cycle`` at a time, and after each cycle waits for the job to finish a
step (recovery). The faults:

=================  ==========================================================================
worker_kill        SIGKILL a rank's process (a policy rank or the tracker actor)
worker_stop        SIGSTOP one for 1-2 s (under the liveness bound: calls just wait) or
                   8 s (over it: its calls fail UnresponsiveError), then SIGCONT
agent_restart      SIGKILL a node agent and start it again on the same port and folder
scheduler_restart  SIGKILL the scheduler, down 0.5-3 s, start it again on the same state
link_flap          a node's link down 0.5-2.5 s (shorter than the fence: nothing is lost)
link_cut           a node's link down for the lease and more: its workers are fenced
=================  ==========================================================================

What is asserted (:meth:`Soak.failures`): every call returned or raised a typed error
within its bound, none hung, values were right; no rank was ever live twice (sampled every
0.2 s); every acknowledged placement group (a ledger, one made per cycle) is still there
after every scheduler restart; after the job, none of its processes is left, no Podium
segment on any node or here, and no TCP port open on a node but its agent's.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import gc
import functools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import podium
from podium.controller.remote.placement import get_placement_group, placement_group, remove_placement_group
from podium.errors import PodiumError
from tests.support.chaosjob import BUILD_BOUND, CALL_BOUND, LIVENESS, MARGIN, Job
from tests.support.faultkit import http_json
from tests.support.shmfiles import segments_of
from tests.support.netlab import NetLab
from tests.support.processes import AgentProcess, SchedulerProcess
from tests.support.waiting import eventually

__all__ = ["FAULTS", "ChaosCluster", "Soak", "NODE_LEASE"]

FAULTS = ("worker_kill", "worker_stop", "agent_restart", "scheduler_restart", "link_flap", "link_cut")
#: The soak's node lease and heartbeat (s): the fence lands L - max(I, L/5) = 4.8 s after
#: the last answered heartbeat, room enough for an agent restart on a loaded machine.
NODE_LEASE, HEARTBEAT = 6.0, 0.5
FENCE = NODE_LEASE - max(HEARTBEAT, NODE_LEASE / 5)
#: Seconds the job has, after a cycle's faults end, to finish a step.
RECOVERY = 240.0
#: Placement groups the ledger keeps (the oldest is removed as a new one is made).
LEDGER = 8


class ChaosCluster:
    """The scheduler and ``nodes`` agents on lab hosts, this process their controller."""

    def __init__(self, lab: NetLab, workdir: Path, token: str, nodes: int = 3) -> None:
        self.lab, self.workdir, self.token = lab, workdir, token
        host = lab.add_host("sched")
        self._sched_launch = functools.partial(lab.popen, host)
        self.flags = ("--heartbeat-interval", str(HEARTBEAT), "--node-lease", str(NODE_LEASE))
        self.scheduler = SchedulerProcess(workdir / "scheduler.db", token, workdir, *self.flags,
                                          host=host.address, launch=self._sched_launch).start()
        self.hosts = {f"n{i}": lab.add_host(f"n{i}") for i in range(nodes)}
        self.agents = {name: self._agent(name) for name in self.hosts}
        for name in self.hosts:
            self.wait_alive(name)
        rt = podium.init(address=self.scheduler.address, token=token, call_timeout=CALL_BOUND,
                         session_lease=60.0)
        rt.placement_timeout = BUILD_BOUND
        rt.deathwatch.liveness.silence = LIVENESS

    def _agent(self, name: str, *extra: str) -> AgentProcess:
        host = self.hosts[name]
        return AgentProcess(self.workdir, self.scheduler.address, host.address, self.token,
                            "--cpus", "8", *extra, launch=functools.partial(self.lab.popen, host))

    def node_state(self, name: str) -> str:
        """NODE_ALIVE / NODE_DEAD / '' for a node ('' also while the scheduler is down)."""
        try:
            nodes = http_json(self.scheduler.http_url + "/v1/placement", self.token)["nodes"]
        except OSError:
            return ""
        node_id = self.agents[name].node_id
        return next((n["state"] for n in nodes if n["node_id"] == node_id), "")

    def wait_alive(self, name: str) -> None:
        """Until the scheduler lists node ``name`` alive (RECOVERY deadline)."""
        eventually(lambda: self.node_state(name) == "NODE_ALIVE", f"node {name} alive", RECOVERY)

    def restart_agent(self, name: str) -> None:
        """SIGKILL node ``name``'s agent; start it again on its port and log folder."""
        old = self.agents[name]
        old.signal(signal.SIGKILL)
        old.port_file.unlink(missing_ok=True)
        self.agents[name] = self._agent(name, "--port", str(old.port))

    def restart_scheduler(self, down: float) -> None:
        """SIGKILL the scheduler, wait ``down`` s, start it on the same state and ports."""
        old = self.scheduler
        old.kill(signal.SIGKILL)
        time.sleep(down)
        self.scheduler = SchedulerProcess(old.state, self.token, self.workdir, *self.flags,
                                          "--port", str(old.port), "--http-port", str(old.http_port),
                                          host=old.host, launch=self._sched_launch).start()

    def close(self) -> None:
        """Controller off; agents and scheduler stopped (the lab kills what is left)."""
        with contextlib.suppress(Exception):
            podium.shutdown()
        for agent in self.agents.values():
            if agent.proc.poll() is None:
                with contextlib.suppress(Exception):
                    agent.signal(signal.SIGTERM)
        with contextlib.suppress(Exception):
            self.scheduler.kill(signal.SIGTERM)


class Soak:
    """Drives :class:`Job` on a :class:`ChaosCluster` through ``faults`` random faults."""

    def __init__(self, cluster: ChaosCluster, faults: int, seed: int, per_cycle: int = 1) -> None:
        self.cluster, self.faults, self.per_cycle = cluster, faults, per_cycle
        self.rng = random.Random(seed)
        self.seed = seed
        self.job = Job()
        self.injected: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.double_live: list[str] = []
        self.ledger: list[str] = []
        self.ledger_lost: list[str] = []
        self.leaks: list[str] = []
        self.recovery: list[float] = []
        self.wall = 0.0
        self._sampling = threading.Event()
        self._own_segments: set[str] = set()
        #: The latest cycle's faults (kind, node, pid), for the notes of what went wrong.
        self.last_cycle: list[tuple[str, str, int]] = []

    # -- the checks that run throughout ---------------------------------------------------
    def _sample(self) -> None:
        while not self._sampling.wait(0.2):
            for role, rank, pids in self.job.book.copies():
                note = f"{role} rank {rank} live in {pids} (cycle {self.last_cycle})"
                if note not in self.double_live:
                    self.double_live.append(note)
            current = self.job.current
            if current is not None:
                what, started, bound = current
                if time.monotonic() - started > bound + MARGIN + 30:
                    self.problems.append(f"hang: {what} running {time.monotonic() - started:.0f} s")
                    faulthandler.dump_traceback(file=sys.stderr)
                    self._sampling.set()

    def _ledger_add(self, cycle: int) -> None:
        """One acknowledged placement group more (its creation returned), the oldest removed."""
        name = f"ledger-{self.seed}-{cycle}"
        with contextlib.suppress(PodiumError):
            placement_group([{"CPU": 0.01}], name=name, lifetime="detached")
            self.ledger.append(name)
        while len(self.ledger) > LEDGER:
            with contextlib.suppress(PodiumError):
                remove_placement_group(get_placement_group(self.ledger[0]))
                self.ledger.pop(0)
                continue
            break

    def _ledger_check(self) -> None:
        for name in self.ledger:
            try:
                get_placement_group(name)
            except PodiumError as exc:
                self.ledger_lost.append(f"{name}: {type(exc).__name__}: {exc}"[:300])

    # -- faults ---------------------------------------------------------------------------
    def _pick_kind(self, busy_nodes: set[str]) -> str:
        kind = self.rng.choice(FAULTS)
        if kind.startswith(("link", "agent")) and len(busy_nodes) == len(self.cluster.hosts):
            kind = "worker_kill"
        return kind

    def _inject(self, kind: str, node: str, pid: int) -> None:
        c = self.cluster
        if kind.startswith("worker") and not pid:
            return  # no rank process is up to hit (the job is between builds)
        if kind == "worker_kill":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        elif kind == "worker_stop":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                time.sleep(self.rng.choice((self.rng.uniform(1, 2), LIVENESS + 3)))
                os.kill(pid, signal.SIGCONT)
        elif kind == "agent_restart":
            c.restart_agent(node)
        elif kind == "scheduler_restart":
            c.restart_scheduler(self.rng.uniform(0.5, 3.0))
        elif kind == "link_flap":
            c.lab.cut(c.hosts[node])
            time.sleep(self.rng.uniform(0.5, FENCE - 2.3))
            c.lab.heal(c.hosts[node])
        elif kind == "link_cut":
            c.lab.cut(c.hosts[node])
            time.sleep(NODE_LEASE + 3)
            c.lab.heal(c.hosts[node])
        self.injected[kind] += 1

    def _inject_noting(self, kind: str, node: str, pid: int) -> None:
        try:
            self._inject(kind, node, pid)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be made is a finding
            self.problems.append(f"{kind} {node}: could not be made: {type(exc).__name__}: {exc}"[:600])

    def _cycle(self, cycle: int) -> None:
        """``per_cycle`` faults at once (each node and the scheduler hit at most once)."""
        kinds, nodes = [], set()
        for _ in range(min(self.per_cycle, self.faults - sum(self.injected.values()))):
            kind = self._pick_kind(nodes)
            if kind == "scheduler_restart" and any(k == kind for k, _, _ in kinds):
                kind = "worker_kill"
            node = self.rng.choice(sorted(set(self.cluster.hosts) - nodes)) if kind.startswith(
                ("link", "agent")) else ""
            nodes.add(node)
            kinds.append((kind, node, self.rng.choice(self.job.victims() or [0])))
        self.last_cycle = kinds
        threads = [threading.Thread(target=self._inject_noting, args=k, daemon=True) for k in kinds]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        if any(t.is_alive() for t in threads):
            self.problems.append(f"cycle {cycle}: a fault injection did not end in 120 s: {kinds}")
        ended, steps = time.monotonic(), self.job.steps
        try:
            for node in self.cluster.hosts:
                self.cluster.wait_alive(node)
        except AssertionError as exc:
            self.problems.append(f"cycle {cycle} ({kinds}): {exc}"[:600])
            self._sampling.set()  # the cluster did not come back: the soak ends here
            return
        if any(k == "scheduler_restart" for k, _, _ in kinds):
            self._ledger_check()
        while self.job.steps < steps + 2:  # the step under way may predate the fault
            if time.monotonic() - ended > RECOVERY:
                self.problems.append(f"cycle {cycle} ({kinds}): no step within {RECOVERY:.0f} s")
                break
            if self._sampling.is_set():
                return
            time.sleep(0.1)
        self.recovery.append(time.monotonic() - ended)
        self._ledger_add(cycle)

    def run(self) -> "Soak":
        """The whole soak: warm up, the faults, the job's end, the leak checks."""
        started = time.monotonic()
        self._own_segments = set(segments_of(os.getpid()))
        sampler = threading.Thread(target=self._sample, name="chaos-sampler", daemon=True)
        sampler.start()
        self.job.start()
        eventually(lambda: self.job.steps >= 3 or self.job.defects, "the job's first steps", RECOVERY)
        cycle = 0
        while sum(self.injected.values()) < self.faults and not self._sampling.is_set():
            self._cycle(cycle)
            cycle += 1
        self._ledger_check()
        self.job.finish(CALL_BOUND * 4)
        self._sampling.set()
        sampler.join(timeout=10)
        for name in list(self.ledger):
            with contextlib.suppress(PodiumError):
                remove_placement_group(get_placement_group(name))
        self._leak_checks()
        self.wall = time.monotonic() - started
        return self

    # -- the end ----------------------------------------------------------------------------
    def _leftovers(self) -> list[str]:
        out = [f"process {pid} of the job still live" for pid in self.job.book.live_pids()]
        # Only this process's segments count on this host: another job on the machine makes
        # its own (the job's workers run in the nodes' namespaces, with /dev/shm of their own).
        out += [f"controller: segment {p}" for p in sorted(set(segments_of(os.getpid())) - self._own_segments)]
        for name, agent in self.cluster.agents.items():
            shm = Path(f"/proc/{agent.proc.pid}/root/dev/shm")
            left = [p for p in os.listdir(shm) if p.startswith("podium")] if shm.exists() else []
            out += [f"node {name}: segment {p}" for p in left]
            listeners = subprocess.run(["ip", "netns", "exec", self.cluster.hosts[name].netns,
                                        "ss", "-Htlnp"], capture_output=True, text=True, timeout=30)
            out += [f"node {name}: a port not its agent's: {line.strip()}"
                    for line in listeners.stdout.splitlines() if f"pid={agent.proc.pid}," not in line]
        return out

    def _leak_checks(self) -> None:
        """With the controller shut down (its task workers stop with it), nothing of the
        job may be left within a minute: processes, segments here and on the nodes, ports."""
        podium.shutdown()
        gc.collect()
        with contextlib.suppress(AssertionError):
            eventually(lambda: not self._leftovers(), "the job's processes, segments and ports gone", 60)
        self.leaks += self._leftovers()

    def failures(self) -> list[str]:
        """Every broken assertion (empty: the soak passed)."""
        return (self.problems + self.job.defects + [f"double-live: {d}" for d in self.double_live]
                + [f"ledger lost: {x}" for x in self.ledger_lost] + [f"leak: {x}" for x in self.leaks])

    def table(self) -> str:
        """The counts, as the soak prints them."""
        rec = sorted(self.recovery) or [0.0]
        calls = self.job.counts
        lines = [f"chaos soak: seed {self.seed}, {sum(self.injected.values())} faults "
                 f"({self.per_cycle} per cycle), {self.wall:.0f} s",
                 "faults: " + ", ".join(f"{k} {self.injected[k]}" for k in FAULTS),
                 f"job: {self.job.steps} steps, {self.job.rebuilds} group builds; calls: "
                 + ", ".join(f"{k} {v}" for k, v in calls.most_common()),
                 f"recovery after a cycle: median {rec[len(rec) // 2]:.1f} s, max {rec[-1]:.1f} s",
                 f"job defects (untyped errors, wrong values, calls over bound): "
                 f"{len(self.job.defects)}; hangs and cycles without recovery: {len(self.problems)}",
                 f"double-live ranks: {len(self.double_live)}; acknowledged placement groups lost: "
                 f"{len(self.ledger_lost)}; leaks: {len(self.leaks)}"]
        lines += [f"  first {kind}: {text}" for kind, text in sorted(self.job.examples.items())]
        return "\n".join(lines + [f"  ! {x}" for x in self.failures()[:20]])
