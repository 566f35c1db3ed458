"""The worker table of the cluster model: slots, creation, spawn and exit reports, stops.

Request validation is in :mod:`podium.scheduler.workerspecs`; what a node's death or a
group's removal means for workers is the cluster model's to decide
(:class:`~podium.scheduler.state.ClusterModel`), carried out by this table's methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from podium import errors
from podium.resources import system_env
from podium.scheduler.groups import GroupTable
from podium.scheduler.records import (LIVE_WORKER_STATES, TERMINAL_WORKER_STATES, Effects,
                                      MasterPlan)
from podium.scheduler.sessions import SessionTable
from podium.scheduler.tables import ChangeLog, RecordTable
from podium.scheduler.workerspecs import CheckedSpec, check_specs
from podium.v1 import common_pb2, scheduler_pb2

__all__ = ["WorkerTable", "RestartsCollector"]


#: Live states a stop request applies to (a STOPPING worker was asked already).
_STOPPABLE = frozenset({common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING})


class WorkerTable(RecordTable[common_pb2.WorkerInfo]):
    """The workers by id, live and ended, in creation order, indexed by group and by node.

    ``groups`` and ``sessions`` check a CreateWorkers request; ``changes`` is marked by
    every change; ``new_id`` makes worker ids; a STARTING worker without a pid
    ``spawn_deadline`` seconds after creation has failed to spawn.
    """

    def __init__(self, changes: ChangeLog, groups: GroupTable, sessions: SessionTable, *,
                 new_id: Callable[[str], str], spawn_deadline: float) -> None:
        super().__init__()
        self._changes = changes
        self._groups = groups
        self._sessions = sessions
        self._new_id = new_id
        #: A STARTING worker without a pid this long after creation has failed to spawn.
        self.spawn_deadline = spawn_deadline
        #: Worker id -> when it fails unless an agent gave it a pid (resolve_unspawned).
        self._unspawned: dict[str, float] = {}
        #: Group id / node id -> ids of the workers in it / on it (insertion-ordered sets):
        #: what a removal, a registration or a slot check looks at, instead of every worker.
        self._by_group: dict[str, dict[str, None]] = {}
        self._by_node: dict[str, dict[str, None]] = {}
        #: Workers created for actors whose previous worker died (spec.restarts > 0), since
        #: this scheduler started: /metrics' podium_actor_restarts_total (RestartsCollector).
        self.actor_restarts = 0

    def _touch(self, worker_ids: Iterable[str]) -> None:
        self._changes.touch(workers=worker_ids)

    def _index(self, worker: common_pb2.WorkerInfo) -> None:
        """Add a new worker to the by-group and by-node indexes."""
        self._by_group.setdefault(worker.spec.placement_group_id, {})[worker.id] = None
        self._by_node.setdefault(worker.node_id, {})[worker.id] = None

    def _unindex(self, worker: common_pb2.WorkerInfo) -> None:
        """Drop a forgotten worker from the indexes."""
        for index, key in ((self._by_group, worker.spec.placement_group_id),
                           (self._by_node, worker.node_id)):
            members = index.get(key)
            if members is not None:
                members.pop(worker.id, None)
                if not members:
                    del index[key]

    def of_group(self, group_id: str) -> list[common_pb2.WorkerInfo]:
        """Every remembered worker of a placement group, in creation order."""
        return [self._records[i] for i in self._by_group.get(group_id, ())]

    def on_node(self, node_id: str) -> list[common_pb2.WorkerInfo]:
        """Every remembered worker of a node, in creation order."""
        return [self._records[i] for i in self._by_node.get(node_id, ())]

    def _check(self, specs: Sequence[common_pb2.WorkerSpec], owner: str) -> list[CheckedSpec]:
        return check_specs(specs, owner, sessions=self._sessions, groups=self._groups,
                           workers=self, workers_of_group=self.of_group)


    def lookup(self, worker_id: str) -> common_pb2.WorkerInfo:
        """A worker by id, or NotFoundError."""
        found = self._records.get(worker_id)
        if found is None:
            raise errors.NotFoundError(f"unknown worker id {worker_id!r}")
        return found

    def select(self, ids: Sequence[str] = (), names: Sequence[str] = (),
                    group: str = "") -> list[common_pb2.WorkerInfo]:
        """Workers by ids, by names (the newest of each name) or by group (rank order).

        Exactly one selector must be given; any unknown id or name is NotFoundError.
        A group lists its live workers (all of them if none is live); an unknown
        group is an empty list.
        """
        given = sum(1 for s in (list(ids), list(names), group) if s)
        if given != 1:
            raise errors.InvalidArgumentError("give exactly one of worker ids, names or group")
        if ids:
            return [self.lookup(i) for i in ids]
        if names:
            out = []
            for name in names:
                matches = [w for w in self._records.values() if w.spec.name == name]
                if not matches:
                    raise errors.NotFoundError(f"unknown worker name {name!r}")
                live = [w for w in matches if w.state in LIVE_WORKER_STATES]
                out.append((live or matches)[-1])
            return out
        members = [w for w in self._records.values() if w.spec.group == group]
        live = [w for w in members if w.state in LIVE_WORKER_STATES]
        return sorted(live or members, key=lambda w: w.spec.rank)

    def plan(self, specs: Sequence[common_pb2.WorkerSpec], owner: str,
                     master_rank: int) -> MasterPlan:
        """Validate a CreateWorkers request (no change) and say where the master is.

        The master is the spec with ``rank == master_rank``; when no spec has it, an
        existing live worker of the same group with that rank provides MASTER_ADDR
        and MASTER_PORT (workers created in several calls).
        """
        return self._plan(specs, self._check(specs, owner), master_rank)

    def _plan(self, specs: Sequence[common_pb2.WorkerSpec], checked: list[CheckedSpec],
              master_rank: int) -> MasterPlan:
        for spec, (_, placed, _, _) in zip(specs, checked):
            if spec.rank == master_rank:
                return MasterPlan(placed.node_id, placed.node_address, 0, True)
        groups = {s.group for s in specs}
        for worker in self._records.values():
            if (worker.spec.group in groups and worker.spec.rank == master_rank
                    and worker.state in LIVE_WORKER_STATES):
                env = worker.env
                return MasterPlan(worker.node_id, env.get("MASTER_ADDR", worker.node_address),
                                  int(env.get("MASTER_PORT", "0") or 0), False)
        raise errors.InvalidArgumentError(
            f"master_rank = {master_rank}: no spec and no live worker of group(s) "
            f"{sorted(groups)} has that rank")

    def create(self, specs: Sequence[common_pb2.WorkerSpec], owner: str,
                       master_rank: int, master_port: int, now: float) -> list[common_pb2.WorkerInfo]:
        """Reserve one slot per spec (all or none) and return the STARTING workers.

        A full slot raises SlotFullError at once. Each worker's env is the system env
        (podium.resources.system_env) plus its spec.env.
        """
        checked = self._check(specs, owner)
        plan = self._plan(specs, checked, master_rank)
        port = plan.port if not plan.need_port else master_port
        if not 0 < port < 65536:
            raise errors.InvalidArgumentError(f"master_port = {port} is not a TCP port")
        created = []
        for spec, (group, placed, _, gpu) in zip(specs, checked):
            worker = common_pb2.WorkerInfo(id=self._new_id("w"), node_id=placed.node_id,
                                           node_address=placed.node_address,
                                           state=common_pb2.WORKER_STARTING,
                                           owner="" if spec.detached else owner)
            worker.spec.CopyFrom(spec)
            if gpu:
                worker.gpu_indices.extend(placed.gpu_indices)
            created.append(worker)
        for worker in created:
            self._records[worker.id] = worker
            self._index(worker)
        self.actor_restarts += sum(1 for w in created if w.spec.restarts > 0)
        # This group's live processes per node (PODIUM_LOCAL_WORLD_SIZE), counted once
        # over the nodes involved, not once per worker over every worker.
        local_counts: dict[tuple[str, str], int] = {}
        for node_id in {w.node_id for w in created}:
            for w in self.on_node(node_id):
                if w.state in LIVE_WORKER_STATES:
                    key = (w.spec.group, node_id)
                    local_counts[key] = local_counts.get(key, 0) + 1
        for worker in created:
            spec = worker.spec
            local = local_counts.get((spec.group, worker.node_id), 0)
            env = system_env(rank=spec.rank, world_size=spec.world_size, master_addr=plan.address,
                             master_port=port, gpu_indices=list(worker.gpu_indices),
                             group=spec.group, local_world_size=local, worker_id=worker.id,
                             node_address=worker.node_address)
            # As Ray does: a worker's math libraries use as many threads as it has CPUs
            # (its spec.env may say otherwise). Unset, every worker of a node starts one
            # OpenMP thread per core, and their spinning threads slow each other down
            # (measured: a 1 MiB DP_COMPUTE_PROTO on 4 CPU workers, 28.6 ms -> 4.2 ms).
            worker.env["OMP_NUM_THREADS"] = str(max(1, int(spec.num_cpus)))
            worker.env.update(dict(spec.env))
            worker.env.update(env)
        self._touch(w.id for w in created)
        # Until an agent gives each a pid, it is owed a spawn (see resolve_unspawned).
        for worker in created:
            self._unspawned[worker.id] = now + self.spawn_deadline
        return created

    def resolve_unspawned(self, now: float) -> Effects:
        """Fail the STARTING workers no agent gave a pid by their deadline; free their slots.

        A worker is committed STARTING before its agent is asked to spawn it; if the
        scheduler dies in between, nobody will spawn it, and it would hold its slot for
        ever (issue #14). Its deadline is ``spawn_deadline`` after creation (past the
        spawn call's own timeout) or ``restore_grace`` after a restart (by when its agent
        has re-registered, listing it if it did start it). The stop effect catches a
        spawn that still happens later.
        """
        effects = Effects()
        for worker_id, deadline in list(self._unspawned.items()):
            worker = self._records.get(worker_id)
            if worker is None or worker.pid or worker.state != common_pb2.WORKER_STARTING:
                del self._unspawned[worker_id]
            elif now >= deadline:
                del self._unspawned[worker_id]
                self.end(worker, common_pb2.WORKER_FAILED, common_pb2.ExitInfo(
                    exit_code=-1, reason=f"never spawned: node {worker.node_id} did not report it "
                                         "(the scheduler restarted before asking for the spawn?)"))
                effects.add_stop(worker.node_id, worker_id)
        return effects

    def mark_spawned(self, worker_id: str, pid: int, log_path: str) -> None:
        """Record the pid and log path the agent gave a just-spawned worker."""
        worker = self.lookup(worker_id)
        if pid and not worker.pid:
            worker.pid = pid
        if log_path:
            worker.log_path = log_path
        self._touch([worker_id])

    def fail(self, worker_ids: Sequence[str], reason: str) -> Effects:
        """Mark workers FAILED (a spawn that did not happen) and release their slots."""
        effects = Effects()
        for worker_id in worker_ids:
            worker = self.lookup(worker_id)
            if worker.state in LIVE_WORKER_STATES:
                self.end(worker, common_pb2.WORKER_FAILED,
                                 common_pb2.ExitInfo(exit_code=-1, reason=reason, requested=True))
                effects.add_stop(worker.node_id, worker_id)
        return effects

    def report(self, request: scheduler_pb2.ReportWorkerRequest) -> None:
        """Apply a node agent's report: RUNNING (pid, port) or EXITED/FAILED (exit).

        Reports about a worker already ended are ignored (a stop we asked for);
        the heartbeat then tells the agent to stop anything still alive.
        """
        worker = self.lookup(request.worker_id)
        if request.node_id and request.node_id != worker.node_id:
            raise errors.InvalidArgumentError(
                f"worker {worker.id!r} runs on node {worker.node_id!r}, not {request.node_id!r}")
        state = request.state
        if state == common_pb2.WORKER_RUNNING:
            if not 0 < request.port < 65536:
                raise errors.InvalidArgumentError(
                    f"worker {worker.id!r}: RUNNING needs its port, got {request.port}")
            if worker.state in (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING):
                worker.state = common_pb2.WORKER_RUNNING
                worker.port = request.port
                if request.pid:
                    worker.pid = request.pid
                if request.HasField("gpu_memory_cap"):
                    worker.gpu_memory_cap.CopyFrom(request.gpu_memory_cap)
                self._touch([worker.id])
        elif state in TERMINAL_WORKER_STATES:
            if worker.state in LIVE_WORKER_STATES:
                if request.pid:
                    worker.pid = request.pid
                self.end(worker, state, self._ended_as_asked(worker, request.exit))
            elif worker.exit.requested and request.HasField("exit"):
                # Keep "requested" but learn how the stopped process actually ended.
                worker.exit.exit_code = request.exit.exit_code
                worker.exit.signal = request.exit.signal
                if request.exit.stderr_tail:
                    worker.exit.stderr_tail = request.exit.stderr_tail
                self._touch([worker.id])
        elif state == common_pb2.WORKER_STOPPING:
            if worker.state in LIVE_WORKER_STATES:
                worker.state = common_pb2.WORKER_STOPPING
                self._touch([worker.id])
        else:
            name = common_pb2.WorkerState.Name(state) if state in common_pb2.WorkerState.values() else state
            raise errors.InvalidArgumentError(f"worker {worker.id!r}: cannot report state {name}")

    def remove(self, worker_ids: Sequence[str]) -> tuple[int, Effects]:
        """Stop workers and release their slots now; (workers that were live, effects)."""
        workers = [self.lookup(i) for i in worker_ids]
        effects = Effects()
        stopped = 0
        for worker in workers:
            if worker.state in _STOPPABLE:
                self.stop(worker, "stopped by request", effects)
                stopped += 1
        return stopped, effects

    def assign(self, assignments: Sequence[scheduler_pb2.WorkerAssignment]) -> list[common_pb2.WorkerInfo]:
        """Hand live workers to a group, rank and world size (all or none): a standby that
        took over a dead rank. A rank held by a STARTING or RUNNING worker of that group is
        refused; a STOPPING holder (a fenced rank whose agent has not confirmed) is not."""
        taken = {(w.spec.group, w.spec.rank): w for w in self._records.values() if w.state in _STOPPABLE}
        moving = {a.worker_id for a in assignments}
        wanted: set[tuple[str, int]] = set()
        workers = []
        for a in assignments:
            worker = self.lookup(a.worker_id)
            label = f"worker {worker.spec.name!r} ({worker.id})"
            if worker.state not in _STOPPABLE:
                raise errors.FailedPreconditionError(
                    f"{label} is {common_pb2.WorkerState.Name(worker.state)}: only a live worker joins a group")
            if not a.group:
                raise errors.InvalidArgumentError(f"{label}: group is required")
            if not 0 <= a.rank < a.world_size:
                raise errors.InvalidArgumentError(
                    f"{label}: rank = {a.rank} must be in [0, world_size={a.world_size})")
            place = f"rank {a.rank} of group {a.group!r}"
            if (a.group, a.rank) in wanted:
                raise errors.InvalidArgumentError(f"{label}: {place} is assigned twice in one request")
            holder = taken.get((a.group, a.rank))
            if holder is not None and holder.id not in moving:
                raise errors.FailedPreconditionError(
                    f"{label}: {place} is held by live worker {holder.spec.name!r} ({holder.id})")
            wanted.add((a.group, a.rank))
            workers.append(worker)
        for worker, a in zip(workers, assignments):
            worker.spec.group, worker.spec.rank, worker.spec.world_size = a.group, a.rank, a.world_size
        self._touch([w.id for w in workers])
        return workers

    def stop(self, worker: common_pb2.WorkerInfo, reason: str, effects: Effects) -> None:
        """Queue a live worker's stop on its node. One that has a process stays STOPPING,
        holding its name, rank and slot, until its node's agent answers the stop
        (:meth:`stopped`), reports it gone or lists it no longer (or the node dies, its
        workers fenced): a StopWorkers that failed (an agent restarting, a
        link down) leaves the process running, and a replacement placed meanwhile would be
        a second live copy of its rank on a double-booked slot. One without a process yet
        ends EXITED at once."""
        requested = common_pb2.ExitInfo(exit_code=-1, reason=reason, requested=True)
        if worker.pid:
            worker.state = common_pb2.WORKER_STOPPING
            worker.exit.CopyFrom(requested)
            self._touch([worker.id])
        else:
            self.end(worker, common_pb2.WORKER_EXITED, requested)
        effects.add_stop(worker.node_id, worker.id)

    def stopped(self, worker_ids: Sequence[str]) -> None:
        """End EXITED the STOPPING workers among ``worker_ids`` that their agent says it
        reaped (its exit report, which may come later, fills in how each ended)."""
        for worker_id in worker_ids:
            worker = self._records.get(worker_id)
            if worker is not None and worker.state == common_pb2.WORKER_STOPPING and worker.exit.requested:
                asked = common_pb2.ExitInfo()
                asked.CopyFrom(worker.exit)
                self.end(worker, common_pb2.WORKER_EXITED, asked)

    def _ended_as_asked(self, worker: common_pb2.WorkerInfo, how: common_pb2.ExitInfo) -> common_pb2.ExitInfo:
        """A stopping worker's exit: the request's reason, with how the process ended."""
        if worker.state != common_pb2.WORKER_STOPPING or not worker.exit.requested:
            return how
        merged = common_pb2.ExitInfo()
        merged.CopyFrom(worker.exit)
        merged.exit_code, merged.signal = how.exit_code, how.signal
        if how.stderr_tail:
            merged.stderr_tail = how.stderr_tail
        return merged

    def end(self, worker: common_pb2.WorkerInfo, state: common_pb2.WorkerState.ValueType,
            exit_info: common_pb2.ExitInfo) -> None:
        """Record how a worker ended (EXITED or FAILED)."""
        # The slot is free as soon as the state is terminal (usage is computed from
        # live workers), so a replacement can be created right away.
        worker.state = state
        worker.exit.CopyFrom(exit_info)
        self._touch([worker.id])

    def reconcile(self, node_id: str, running: Sequence[scheduler_pb2.RunningWorker], *,
                  registering: bool) -> Effects:
        """Match what a node's agent says it runs against the records.

        Known live workers of this node get their pid, port and memory cap; running workers
        the scheduler does not want are returned to stop. ``registering``: a worker the
        agent spawned (it has a pid) but no longer lists died with the previous agent, and
        is marked EXITED; one without a pid may still be in an in-flight spawn.
        """
        effects = Effects()
        alive_ids = set()
        for item in running:
            alive_ids.add(item.worker_id)
            worker = self._records.get(item.worker_id)
            if worker is None or worker.node_id != node_id or worker.state not in LIVE_WORKER_STATES \
                    or worker.state == common_pb2.WORKER_STOPPING:  # still running: ask again
                effects.add_stop(node_id, item.worker_id)
                continue
            changed = False
            if item.pid and worker.pid != item.pid:
                worker.pid = item.pid
                changed = True
            if item.port and worker.state == common_pb2.WORKER_STARTING:
                worker.port = item.port
                worker.state = common_pb2.WORKER_RUNNING
                changed = True
            if item.HasField("gpu_memory_cap") and worker.gpu_memory_cap != item.gpu_memory_cap:
                worker.gpu_memory_cap.CopyFrom(item.gpu_memory_cap)
                changed = True
            if changed:
                self._touch([worker.id])
        # Registering, a spawned worker the agent no longer lists died with the previous
        # agent; on any beat, a stopping one it no longer lists is gone (the list is whole).
        for worker in self.on_node(node_id):
            if (worker.pid and worker.id not in alive_ids
                    and (worker.state == common_pb2.WORKER_STOPPING
                         or (registering and worker.state in LIVE_WORKER_STATES))):
                self.end(worker, common_pb2.WORKER_EXITED, self._ended_as_asked(worker, common_pb2.ExitInfo(
                    exit_code=-1, reason=f"not running on node {node_id} after it re-registered")))
        return effects

    def end_on_node(self, node_id: str, reason: str) -> None:
        """End every live worker of a node EXITED with ``reason`` (the node died: there is
        nobody to stop them)."""
        for worker in self.on_node(node_id):
            if worker.state in LIVE_WORKER_STATES:
                self.end(worker, common_pb2.WORKER_EXITED,
                         common_pb2.ExitInfo(exit_code=-1, reason=reason))

    def stop_group(self, group_id: str, reason: str) -> tuple[int, Effects]:
        """Stop every live worker of a placement group; (workers stopped, effects)."""
        effects = Effects()
        count = 0
        for worker_id in list(self._by_group.get(group_id, ())):
            worker = self._records[worker_id]
            if worker.state in _STOPPABLE:
                self.stop(worker, reason, effects)
                count += 1
        return count, effects

    def stop_owned(self, session_id: str, reason: str) -> tuple[int, Effects]:
        """Stop the live workers that die with a session (its own, not detached)."""
        effects = Effects()
        count = 0
        for worker in self._records.values():
            if (worker.owner == session_id and not worker.spec.detached
                    and worker.state in _STOPPABLE):
                self.stop(worker, reason, effects)
                count += 1
        return count, effects

    def prune(self, keep: int) -> None:
        """Forget the oldest ended workers beyond ``keep``."""
        ended = [w.id for w in self._records.values() if w.state in TERMINAL_WORKER_STATES]
        for worker_id in ended[:max(0, len(ended) - keep)]:
            self._unindex(self._records.pop(worker_id))
            self._touch([worker_id])

    def restore(self, workers: Iterable[common_pb2.WorkerInfo], unspawned_until: float) -> None:
        """Load persisted workers. A STARTING one without a pid fails at ``unspawned_until``
        unless its agent lists it by then: its spawn died with the previous scheduler."""
        for worker in workers:
            self._records[worker.id] = worker
            self._index(worker)
            if worker.state == common_pb2.WORKER_STARTING and not worker.pid:
                self._unspawned[worker.id] = unspawned_until


class RestartsCollector:
    """``podium_actor_restarts_total`` on the scheduler's /metrics: workers created to restart
    an actor (Ray's max_restarts), read from the worker table when scraped."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def collect(self):
        """The one counter family (prometheus_client's collector protocol)."""
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily("podium_actor_restarts", "Actor restarts (max_restarts) since the scheduler started",
                                  value=self.model.workers.actor_restarts)
