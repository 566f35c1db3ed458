"""The replacement soak (issue #51, goal "0 ranks live twice, over 200 kills and stops in a
row"): one rank of a group with ``on_rank_death="replace"`` SIGKILLed or SIGSTOPped, again
and again, and after each replacement every promise checked from outside.

The cluster is real processes (:func:`tests.support.clusters.two_node_processes`: a
scheduler and two node agents on 127.0.0.2 and 127.0.0.3); this process is the controller.
A group of :data:`RANKS` ranks with :data:`STANDBY` warm standbys replaces its dead ranks by
itself; it is rebuilt every ``per_group`` replacements, so both standbys and fresh workers
take ranks. Each fault, one after another:

1. a call (``nap``) is in flight on every rank; the victim (a seeded random rank) gets
   SIGKILL or SIGSTOP, alternately; the call must fail with WorkerDiedError (SIGKILL) or
   UnresponsiveError (SIGSTOP, found by liveness) naming the victim's rank;
2. the next call replaces the rank (fence, handover, rendezvous) and must be served;
3. the checks, from outside the group: the victim's process is gone (a stopped one gets its
   SIGCONT only after that, and must stay gone); the process table below the agents holds
   exactly the group's ranks and standbys; the scheduler records each rank index once, with
   the pid that serves it; each rank answers its index in ``self.rank`` and ``RANK`` and the
   group's rendezvous version; a :class:`~tests.support.chaosjob.RankBook` of every process
   that ever held a rank (sampled every 0.2 s as well) finds no rank live twice.

At the end (:meth:`ReplaceSoak.finish`): no process below the agents, no live worker and no
placement group in the scheduler's records, no ``/dev/shm`` segment of any process the soak
made. ``python -m bench.replace_soak --faults 200`` is the long run;
``tests/cluster/test_replace_soak.py`` the short one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import random
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import podium
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.controller.session.runtime import get_runtime
from podium.errors import PodiumError, UnresponsiveError, WorkerDiedError
from podium.transport import shm
from podium.v1 import common_pb2
from podium.worker import Dispatch, Worker, register
from podium.worker.rendezvous import Rendezvous, on_rendezvous
from tests.support.chaosjob import RankBook
from tests.support.clusters import two_node_processes
from tests.support.proctable import alive, descendants
from tests.support.waiting import eventually

__all__ = ["RANKS", "STANDBY", "LIVENESS", "Ranked", "ReplaceSoak", "soak_cluster"]

#: Ranks of the soak's group and its warm standbys (rebuilt every ``per_group`` faults).
RANKS, STANDBY = 4, 2
#: The liveness bound (s) the soak runs with: a SIGSTOPped rank's call fails after it.
LIVENESS = 3.0
#: Seconds the in-flight call sleeps in every rank; the fault lands :data:`LAND` s into it.
NAP, LAND = 2.0, 0.3
#: Calls after a fault before the group must serve (each may fail typed once more).
TRIES = 4
#: Seconds a call may take before it counts as hung (far over every bound in play).
HUNG = 180.0
#: Worker states that hold a slot and may hold a process.
_LIVE = (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING, common_pb2.WORKER_STOPPING)
_KINDS = {"kill": (signal.SIGKILL, WorkerDiedError), "stop": (signal.SIGSTOP, UnresponsiveError)}


class Ranked(Worker):
    """A rank that says who it is: its rank, ``RANK`` and the rendezvous versions it took."""

    def __init__(self) -> None:
        super().__init__()
        self.versions = [0]
        self.wrong: list[str] = []

    @on_rendezvous
    def learn(self, rdzv: Rendezvous) -> None:
        """Keep each version; note a hook whose rank disagrees with the env's."""
        if rdzv.rank != self.rank or str(rdzv.rank) != os.environ["RANK"]:
            self.wrong.append(f"version {rdzv.version}: rdzv.rank {rdzv.rank}, self.rank {self.rank}, "
                              f"RANK {os.environ['RANK']}")
        self.versions.append(rdzv.version)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        """Sleep (the call a fault lands in)."""
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def identity(self) -> tuple[int, int, int, int, list[str]]:
        """(self.rank, RANK, the last rendezvous version, pid, hook complaints)."""
        return self.rank, int(os.environ["RANK"]), self.versions[-1], os.getpid(), self.wrong


@contextlib.contextmanager
def soak_cluster(workdir: Path):
    """A scheduler and two node agents as processes, this process their controller (with
    the soak's liveness bound); yields the agents' pids."""
    with two_node_processes(workdir, gpus_per_node=0, cpus=16) as cluster:
        rt = podium.init(address=cluster.address, token=cluster.token, log_to_driver=False)
        try:
            eventually(lambda: len(rt.run(rt.cluster_state()).nodes) == 2, "both node agents registered", 60)
            agents = {proc.pid for proc in cluster.agents.values()}
            # Each agent's fork helper is up (the soak tells workers from helpers by it).
            eventually(lambda: all(descendants({pid}) for pid in agents), "the agents' fork helpers", 60)
            rt.deathwatch.liveness.silence = LIVENESS
            yield agents
        finally:
            podium.shutdown()


def worker_pids(agents: set[int], helpers: set[int]) -> set[int]:
    """Live worker processes below the agents: all but their fork ``helpers`` (what was below
    them before any worker started)."""
    return descendants(agents) - helpers


class ReplaceSoak:
    """``faults`` faults, one at a time, with the checks after each (module docstring)."""

    def __init__(self, agents: set[int], faults: int, seed: int, per_group: int = 10) -> None:
        self.agents, self.faults, self.per_group = agents, faults, per_group
        self.rng, self.seed = random.Random(seed), seed
        self.book = RankBook()
        self.injected: collections.Counter[str] = collections.Counter()
        self.sources: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.double_live: list[str] = []
        self.leaks: list[str] = []
        self.groups = 0
        #: Per fault kind: seconds from the fault to its call's error, and to the next call served.
        self.detection: dict[str, list[float]] = collections.defaultdict(list)
        self.served: dict[str, list[float]] = collections.defaultdict(list)
        self.steps: dict[str, list[float]] = collections.defaultdict(list)
        self.wall = 0.0
        #: Every process the soak made (their segments count at the end), and those booked.
        self._pids: set[int] = set()
        self._booked: set[int] = set()
        self._shm_before: set[str] = set()
        self._stop = threading.Event()
        #: The agents' fork helpers (below them before the first group): no workers.
        self._helpers = descendants(agents)

    # -- the group ----------------------------------------------------------------------------
    def _build(self) -> WorkerGroup:
        self.groups += 1
        wg = WorkerGroup(ResourcePool([RANKS], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Ranked),
                         name_prefix=f"soak{self.seed}g{self.groups}", standby=STANDBY, on_rank_death="replace")
        self._note(wg)
        return wg

    def _note(self, wg: WorkerGroup) -> None:
        """Book every process that holds a rank of ``wg`` now (and keep its pid for the end)."""
        for rank, w in enumerate(wg.workers):
            if w.pid not in self._booked:  # a standby is booked when it takes a rank
                self._booked.add(w.pid)
                self.book.record(wg.name_prefix, rank, w.pid)
        self._pids.update(w.pid for w in [*wg.workers, *wg.standby_workers])

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            for group, rank, pids in self.book.copies():
                note = f"{group} rank {rank} live in {pids}"
                if note not in self.double_live:
                    self.double_live.append(note)

    # -- one fault ----------------------------------------------------------------------------
    def _fault(self, wg: WorkerGroup, number: int) -> None:
        kind = ("kill", "stop")[number % 2]
        sig, expected = _KINDS[kind]
        victim = self.rng.randrange(RANKS)
        old = wg.workers[victim]
        source = "standby" if wg.standby_workers else "fresh worker"
        version = wg.rendezvous_version
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(wg.nap, NAP)
            time.sleep(LAND)
            struck = time.monotonic()
            os.kill(old.pid, sig)
            self.injected[kind] += 1
            concurrent.futures.wait([pending], timeout=HUNG)
            if not pending.done():
                self.problems.append(f"fault {number} ({kind} rank {victim}): the call in flight hung")
                self._stop.set()
                return
            try:
                pending.result()
                self.problems.append(f"fault {number} ({kind} rank {victim}): the call in flight returned")
            except Exception as exc:  # noqa: BLE001 - an untyped error is a finding
                self.errors[type(exc).__name__] += 1
                if not isinstance(exc, expected) or exc.rank != victim:
                    self.problems.append(f"fault {number} ({kind} rank {victim}): the call in flight raised "
                                         f"{type(exc).__name__} (rank {getattr(exc, 'rank', None)}): {exc}"[:400])
        self.detection[kind].append(time.monotonic() - struck)
        ids = self._served(wg, number)
        if ids is None:
            return
        self.served[kind].append(time.monotonic() - struck)
        for step, seconds in wg.last_replacement.items():
            self.steps[f"{kind} {step}"].append(seconds)
        self.sources[source] += 1
        self._note(wg)
        # Fenced before anyone took its place: gone now, and a SIGCONT brings nothing back.
        if alive(old.pid):
            self.double_live.append(f"fault {number}: replaced rank {victim} (pid {old.pid}) still live")
        if sig == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGCONT)
        self._check(wg, ids, number, version, old)

    def _served(self, wg: WorkerGroup, number: int) -> list | None:
        """The first call after the fault that is served (each try may fail typed once more)."""
        for _ in range(TRIES):
            try:
                return wg.identity()
            except Exception as exc:  # noqa: BLE001 - typed ones are counted, others are findings
                self.errors[f"after: {type(exc).__name__}"] += 1
                if not isinstance(exc, PodiumError):
                    self.problems.append(f"fault {number}: untyped error after it: {type(exc).__name__}: {exc}"[:400])
                last = exc
        self.problems.append(f"fault {number}: not served in {TRIES} calls: {type(last).__name__}: {last}"[:400])
        return None

    def _check(self, wg: WorkerGroup, ids: list, number: int, version: int, old: Any) -> None:
        """The checks after a replacement (module docstring, step 3)."""
        rt = get_runtime()
        where = f"fault {number} ({wg.name_prefix})"
        ranks = [w.pid for w in wg.workers]
        spare = {w.pid for w in wg.standby_workers}
        live = worker_pids(self.agents, self._helpers)
        if alive(old.pid):
            self.double_live.append(f"{where}: the replaced process {old.pid} is live after SIGCONT")
        if len(set(ranks)) != RANKS:
            self.double_live.append(f"{where}: one process holds two ranks: {ranks}")
        extra, missing = live - set(ranks) - spare, (set(ranks) | spare) - live
        if extra:
            self.double_live.append(f"{where}: processes below the agents that are no rank or standby: {extra}")
        if missing:
            self.problems.append(f"{where}: ranks or standbys with no live process: {missing} (below the "
                                 f"agents {self.agents}: {sorted(descendants(self.agents))})")
        records = rt.run(rt.scheduler.get_workers(group=wg.name_prefix))
        got = sorted((w.spec.rank, w.id, w.pid) for w in records if w.state in _LIVE)
        want = [(r, w.worker_id, w.pid) for r, w in enumerate(wg.workers)]
        if got != want:
            self.double_live.append(f"{where}: the scheduler records {got}, the group holds {want}")
        [gone] = rt.run(rt.scheduler.get_workers(ids=[old.worker_id])) or [None]
        if gone is not None and gone.state in _LIVE:
            self.double_live.append(f"{where}: the scheduler still lists {old.worker_id} {gone.state}")
        now = wg.rendezvous_version
        if now <= version:
            self.problems.append(f"{where}: rendezvous version {now} after {version}")
        for r, (rank, env_rank, seen, pid, wrong) in enumerate(ids):
            if (rank, env_rank, seen, pid) != (r, r, now, ranks[r]) or wrong:
                self.double_live.append(f"{where}: rank {r} answered rank {rank}, RANK {env_rank}, version "
                                        f"{seen} (group's {now}), pid {pid} (group's {ranks[r]}) {wrong}")
        for group, rank, pids in self.book.copies():
            self.double_live.append(f"{where}: {group} rank {rank} live in {pids}")

    # -- the whole soak -------------------------------------------------------------------------
    def run(self) -> "ReplaceSoak":
        """The faults, then :meth:`finish`."""
        started = time.monotonic()
        self._pids.add(os.getpid())
        self._shm_before = set(os.listdir(shm.SHM_DIR))
        sampler = threading.Thread(target=self._sample, name="replace-soak-sampler", daemon=True)
        sampler.start()
        wg: WorkerGroup | None = None
        in_group = 0
        try:
            for number in range(self.faults):
                if self._stop.is_set():
                    break
                if wg is None or in_group >= self.per_group:
                    if wg is not None:
                        wg.shutdown()
                    wg, in_group = self._build(), 0
                self._fault(wg, number)
                in_group += 1
        finally:
            if wg is not None:
                with contextlib.suppress(Exception):
                    wg.shutdown()
            self._stop.set()
            sampler.join(timeout=10)
        self.finish()
        self.wall = time.monotonic() - started
        return self

    def _leftovers(self) -> list[str]:
        rt = get_runtime()
        state = rt.run(rt.cluster_state())
        out = [f"process {pid} below the agents" for pid in sorted(worker_pids(self.agents, self._helpers))]
        out += [f"worker {w.id} ({w.spec.name}) in state {w.state}" for w in state.workers if w.state in _LIVE]
        out += [f"placement group {pg.id}" for pg in state.placement_groups if pg.state != common_pb2.PG_REMOVED]
        starts = tuple(f"{shm.PREFIX}{pid}-" for pid in self._pids)
        out += [f"segment {n}" for n in sorted(set(os.listdir(shm.SHM_DIR)) - self._shm_before) if n.startswith(starts)]
        return out

    def finish(self) -> None:
        """With the last group shut down, nothing of the soak may be left within a minute."""
        with contextlib.suppress(AssertionError):
            eventually(lambda: not self._leftovers(), "the soak's processes, slots and segments gone", 60)
        self.leaks += self._leftovers()

    def failures(self) -> list[str]:
        """Every broken promise (empty: the soak passed)."""
        return (self.problems + [f"double-live: {d}" for d in self.double_live]
                + [f"leak: {x}" for x in self.leaks])

    def table(self) -> str:
        """The counts, as the soak prints them."""
        def spread(values: list[float]) -> str:
            return f"median {statistics.median(values):.2f} s, max {max(values):.2f} s" if values else "none"
        lines = [f"replacement soak: seed {self.seed}, {sum(self.injected.values())} faults, {self.groups} groups "
                 f"of {RANKS} ranks + {STANDBY} standbys, {self.wall:.0f} s",
                 "faults: " + ", ".join(f"{k} {self.injected[k]}" for k in _KINDS),
                 "taken by: " + ", ".join(f"{k} {v}" for k, v in self.sources.most_common()),
                 "typed errors: " + ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())),
                 *(f"{kind}: fault to the call's error {spread(self.detection[kind])}; to the next call "
                   f"served {spread(self.served[kind])}" for kind in _KINDS),
                 *(f"  {step}: {spread(values)}" for step, values in sorted(self.steps.items())),
                 f"ranks live twice: {len(self.double_live)}; other problems: {len(self.problems)}; "
                 f"leftovers: {len(self.leaks)}"]
        return "\n".join(lines + [f"  ! {x}" for x in self.failures()[:20]])
