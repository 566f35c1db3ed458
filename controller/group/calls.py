"""The call object of a WorkerGroup: :class:`GroupCaller` fans one call out to the group's
ranks and gathers their results. It sends the ranks their calls concurrently (blocking, or
``blocking=False`` with PendingRefs), encodes a payload several ranks share once, stages
same-host payloads in shared memory, keeps every call under its deadline, and turns broken
streams into WorkerDiedError. Binding the user's methods (:mod:`.binding`) and verl's
``execute_*`` names (:mod:`.workergroup`) both go through it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import operator
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from podium.controller.dispatch import modes as _dispatch
from podium.controller.session.calltimeout import effective_call_timeout, plus
from podium.controller.session.deathwatch import died_error
from podium.controller.session.argrefs import refs_inside, resolve_args
from podium.controller.session.futures import PendingRef, is_pending
from podium.controller.group.gather import GroupGather, RankOutcome
from podium.controller.group.handle import WorkerHandle, no_arguments
from podium.controller.group.members import GroupMembers
from podium.controller.session.loopqueue import soon
from podium import limits
from podium.tracering import RING, next_trace_id, now_ns
from podium.transport.shmpool import REF_MIN_BYTES
from podium.transport.shmstage import STAGE
from podium.errors import (DeadlineExceededError, FailedPreconditionError, RemoteError,
                           ResourceExhaustedError, UnavailableError, UnresponsiveError, WorkerDiedError)
from podium.worker.factory import by_value


if TYPE_CHECKING:
    from podium.controller.session.contract import Session

__all__ = ["GroupCaller", "Route", "direct_route"]

log = logging.getLogger("podium.controller")

#: The exceptions of a failed torch.distributed rendezvous: the other ranks wait in it (for
#: torch's 30-minute default), so the group is broken (GroupMembers.broken).
_RENDEZVOUS_ERRORS = frozenset({"torch.distributed.DistNetworkError", "torch.distributed.DistStoreError"})
#: How long to poll the scheduler for a dead worker's exit record.
_DEATH_LOOKUP_SECONDS = 5.0
#: After one rank's deadline, how long the others (same deadline) get to answer or expire.
_DEADLINE_GRACE_SECONDS = 1.0
_NBYTES = operator.attrgetter("nbytes")

#: ``route(method_name, args) -> (remote_name, remote_args)``: what a worker is asked to run.
Route = Callable[[str, tuple], "tuple[str, tuple]"]


def direct_route(method_name: str, args: tuple) -> tuple[str, tuple]:
    """The worker runs the method of that name with the arguments as given."""
    return method_name, args


#: What a collective raises in a rank whose peer process went away (gloo, NCCL).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")


def _peer_lost(exc: RemoteError) -> bool:
    """Whether a rank's error says a peer of its collective went away."""
    return any(marker in exc.message for marker in _PEER_LOST)


def _keep_until_done(owned: Any, _ref: Any) -> None:
    """A done-callback whose only job is to hold ``owned`` (put values) until the call ends."""


class GroupCaller:
    """Runs calls on the ranks of one group and gathers the results.

    ``GroupCaller(rt, members, label)``: ``rt`` is the controller runtime (its loop, call
    timeout, scheduler), ``members`` the group's :class:`GroupMembers` (read at each call),
    ``label`` names the group in messages, ``route`` maps a method to what the workers run
    (a fused role's view routes through the fused worker). Once closed (:meth:`close`) it
    refuses new calls and reports a broken worker's error as it is.
    """

    def __init__(self, rt: Session, members: GroupMembers, label: str, route: Route = direct_route) -> None:
        self._rt = rt
        self._members = members
        self._route = route
        #: The group's name in messages.
        self.label = label
        #: Whether the group was shut down (no new calls).
        self.closed = False
        #: The trace id of the last call :meth:`run` made (its ranks' spans carry it).
        self.last_trace = 0
        #: An actor's constructor still running (a ``concurrent.futures.Future``), or None:
        #: ``blocking=False`` calls made meanwhile are queued, in order, and sent once it
        #: finished (they fail with its error when it failed), as Ray's actor calls wait.
        self.gate: Any = None
        self._gate_lock = threading.Lock()
        self._queued: list | None = None
        #: Bytes of the arguments :attr:`_queued` keeps (bounded: limits.MAX_QUEUED_BYTES).
        self._queued_bytes = 0
        #: Run (on the caller's thread) before each call: a group with
        #: ``on_rank_death="replace"`` replaces its dead ranks there.
        self.before_call: Callable[[], None] | None = None

    def routed(self, route: Route | None = None) -> "GroupCaller":
        """A caller over the same runtime and members with its own closed flag and
        ``route`` (default: this caller's): a view's."""
        other = GroupCaller(self._rt, self._members, self.label, self._route if route is None else route)
        other.closed = self.closed
        return other

    def close(self) -> None:
        """Refuse new calls from now on."""
        self.closed = True

    def run_all(self, method_name: str, per_rank: list[tuple[tuple, dict]], blocking: bool) -> list:
        """:meth:`run` on every rank."""
        return self.run(list(range(self._members.world_size)), method_name, per_rank, blocking)

    def run(self, ranks: list[int], method_name: str, per_rank: list[tuple[tuple, dict]], blocking: bool) -> list:
        """Call ``method_name`` on ``ranks`` concurrently: values when blocking, else PendingRefs."""
        if self.closed:
            # A WorkerDiedError, as Ray's ActorDiedError for a call on a killed actor.
            raise WorkerDiedError(f"WorkerGroup {self.label!r} is shut down")
        if self.before_call is not None:
            self.before_call()
        if self._members.broken is not None:
            raise FailedPreconditionError(
                f"WorkerGroup {self.label!r} is broken: {self._members.broken}; replace its ranks "
                "(wg.replace_rank, or on_rank_death='replace') or start a new group")
        trace = self.last_trace = next_trace_id()
        started = now_ns() if RING.on else 0
        try:
            return self._run(ranks, method_name, per_rank, blocking, trace)
        finally:
            if started:
                # Blocking: sending and waiting for every rank; else sending (the refs settle later).
                RING.add("execute" if blocking else "submit", f"{self.label}.{method_name}", started, now_ns(), trace)

    def _run(self, ranks: list[int], method_name: str, per_rank: list[tuple[tuple, dict]], blocking: bool,
             trace: int) -> list:
        rt = self._rt
        calls = []
        last: Any = None
        for rank, entry in zip(ranks, per_rank):
            if entry is not last:  # ONE_TO_ALL's ranks share one entry: prepared once
                last = entry
                name, args = self._route(method_name, entry[0])
                kwargs = entry[1]
            calls.append((rank, name, args, kwargs))
        timeout = effective_call_timeout(rt.call_timeout)  # a `with call_timeout(s):` block's
        if blocking and self.gate is not None:  # the constructor first (its error is this call's)
            try:
                self.gate.result(timeout=plus(timeout, 10))  # it runs within the call timeout
            except concurrent.futures.TimeoutError:
                raise DeadlineExceededError(f"{method_name}: the actor's constructor did not finish within "
                                            f"{plus(timeout, 10):g}s") from None
        if blocking:
            return rt.run(self._call_all(calls, hold=False, timeout=timeout, trace=trace), timeout=plus(timeout, 10),
                          what=f"{method_name} on {len(ranks)} ranks")
        workers = self._members.workers
        # A held result lives in its worker until nothing here can name it any more: each
        # ref releases it when it is garbage (PendingRef.__del__).
        refs = [PendingRef(rank, method_name, workers[rank].held_releaser(rt)) for rank, *_ in calls]
        # The refs the arguments carry, at any depth: their values (put() here, or results
        # held in workers) live until the call finished, so the callee can read them.
        entries = {id(e): e for e in per_rank}.values()  # ONE_TO_ALL's ranks share one entry
        inside = refs_inside([v for args, kwargs in entries for v in (*args, *kwargs.values())])
        if inside:
            keep_alive = functools.partial(_keep_until_done, inside)
            for ref in refs:
                ref.add_done_callback(keep_alive)
        if self.gate is not None and self._behind_gate(calls, refs, timeout, trace):
            return refs
        if any(is_pending(v) for v in inside):
            # Arguments that are still computing: resolved, then encoded, in a task on the loop.
            soon(rt.loop, self._start_when_resolved, calls, refs, timeout, trace)
            return refs
        # The arguments are encoded here and their buffers copied before the call returns:
        # the call sends them later, from the loop, and must send what they were now.
        try:
            payloads = self.encode_payloads(calls, snapshot=self._snapshot)
        except BaseException as exc:  # noqa: BLE001 - reported through every rank's ref
            for ref in refs:
                ref.set_exception(exc)
            return refs
        soon(rt.loop, self._submit_all, calls, payloads, True, refs, timeout, None, trace)  # one wake-up per burst
        # Payloads copied while they are sent (a bulk frame on plain TCP) are copied now, as
        # the loop starts sending them: the call returns once each is sent or copied.
        for payload in {id(p): p for p in payloads.values()}.values():
            if payload.copying is not None:
                payload.copying.run()
        return refs

    def _behind_gate(self, calls: list, refs: list[PendingRef], timeout: float | None, trace: int) -> bool:
        """Queue a ``blocking=False`` call behind :attr:`gate`; False once the constructor
        succeeded and every call queued before has been sent (then the call goes as usual).
        Its arguments are encoded and copied now (later changes to them are not sent) unless
        some are still computing (resolved first, as without a gate)."""
        payloads = None
        if not any(is_pending(v) for v in refs_inside([v for _, _, a, k in calls for v in (*a, *k.values())])):
            try:
                payloads = self.encode_payloads(calls, snapshot=lambda _ranks, payload: payload.snapshot())
            except BaseException as exc:  # noqa: BLE001 - reported through every rank's ref
                for ref in refs:
                    ref.set_exception(exc)
                return True
        with self._gate_lock:
            gate = self.gate
            if gate is None:
                return False
            if gate.done() and self._queued is None:
                error = gate.exception()
                if error is None:
                    self.gate = None
                    return False
                for ref in refs:
                    ref.set_exception(error)
                return True
            nbytes = sum({id(p): p.nbytes for p in payloads.values()}.values()) if payloads else 0
            queued = len(self._queued or ())
            if queued >= limits.MAX_QUEUED_CALLS or self._queued_bytes + nbytes > limits.MAX_QUEUED_BYTES:
                raise ResourceExhaustedError(
                    f"{self.label}.{calls[0][1]}: {queued} calls with {self._queued_bytes} bytes of arguments "
                    f"already wait for the actor's constructor (bounds: {limits.MAX_QUEUED_CALLS} calls, "
                    f"{limits.MAX_QUEUED_BYTES} bytes); wait for it first (podium.get on a call's result)")
            if self._queued is None:
                self._queued = []
                gate.add_done_callback(lambda _: soon(self._rt.loop, self._drain_gate))
            self._queued.append((calls, payloads, refs, timeout, trace, nbytes))
            self._queued_bytes += nbytes
            return True

    def _drain_gate(self) -> None:
        """Send the calls queued behind the finished :attr:`gate`, in order (on the loop)."""
        asyncio.get_running_loop().create_task(self._send_queued())

    async def _send_queued(self) -> None:
        error = self.gate.exception()
        while True:
            with self._gate_lock:
                if not self._queued:  # calls made from now on go as usual (or fail at once)
                    self._queued = None
                    if error is None:
                        self.gate = None
                    return
                calls, payloads, refs, timeout, trace, nbytes = self._queued.pop(0)
                self._queued_bytes -= nbytes
            if error is not None:
                for ref in refs:
                    ref.set_exception(error)
            elif payloads is not None:
                self._submit_all(calls, payloads, True, refs, timeout, None, trace)
            else:
                await self._call_all(calls, hold=True, sinks=refs, timeout=timeout, trace=trace)

    def _start_when_resolved(self, calls: list, sinks: list[PendingRef], timeout: float | None = None,
                             trace: int = 0) -> None:
        """Start a ``blocking=False`` call whose arguments include results still computing."""
        asyncio.get_running_loop().create_task(self._call_all(calls, hold=True, sinks=sinks, timeout=timeout,
                                                              trace=trace))

    def _snapshot(self, ranks: list[int], payload: Any) -> Any:
        """``payload`` copied as it is now for ``ranks``: into the one rank's shared memory when
        it reads it there (:meth:`WorkerClient.snapshot`), else into memory of its own."""
        if len(ranks) == 1:
            return self._members.workers[ranks[0]].client.snapshot(payload)
        return payload.snapshot()

    @staticmethod
    def encode_payloads(prepared: list, snapshot: Callable | None = None) -> dict[int, Any]:
        """The encoded payload of each call; ranks given the very same objects share one.

        ``snapshot(ranks, payload)``: the payload copied as it is now, for a call that
        returns before it is sent."""
        from podium.worker.caller.client import prepare
        groups = _dispatch.unique_payload_groups([(a, k) for _, _, a, k in prepared])
        payloads: dict[int, Any] = {}
        for members in groups:
            _, _, args, kwargs = prepared[members[0]]
            if not args and not kwargs:
                payload = no_arguments()
            else:
                funcs = [v for v in (*args, *kwargs.values()) if callable(v)]
                with by_value(*funcs):
                    payload = prepare((tuple(args), dict(kwargs)))
                if snapshot is not None:
                    payload = snapshot([prepared[i][0] for i in members], payload)
            for i in members:
                payloads[i] = payload
        return payloads

    async def _call_all(self, calls: list, hold: bool, sinks: list | None = None,
                        timeout: float | None = None, trace: int = 0) -> list:
        try:
            prepared = []
            last: Any = None
            for rank, name, args, kwargs in calls:
                if last is None or args is not last[0] or kwargs is not last[1]:
                    last = (args, kwargs)  # ranks sharing their arguments share the resolved ones
                    resolved = await resolve_args(args, kwargs)
                prepared.append((rank, name, *resolved))
            payloads = self.encode_payloads(prepared)
        except BaseException as exc:
            if sinks is None:
                raise
            for sink in sinks:
                sink.set_exception(exc)
            return []
        staged = await self._stage(prepared, payloads)
        gather = None
        try:
            if sinks is not None:
                self._submit_all(prepared, payloads, hold, sinks, timeout, None, trace)
            else:  # a blocking call's outcomes land in the slots of one gather: no future per rank
                gather = GroupGather(len(prepared))
                self._submit_all(prepared, payloads, hold, gather.ranks, timeout, RankOutcome.set_exception, trace)
        finally:
            if staged is not None:
                # Each rank's call pins the segment itself as it starts (its task's first
                # step, queued before this): until then the group call's own pin holds it.
                asyncio.get_running_loop().call_soon(STAGE.unpin, staged)
        if gather is None:
            return []
        await gather.first_failure_or_all()
        failed = gather.failed()
        first = gather.ranks[failed[0]].error if failed else None
        if isinstance(first, RemoteError) and _peer_lost(first):
            # A rank's collective saw its peer go: the peer's death is the call's error (the
            # dead rank's stream breaks within moments; the other ranks' errors follow from it).
            await gather.all_settled(_DEADLINE_GRACE_SECONDS)
            failed = gather.failed()
            died = [i for i in failed if isinstance(gather.ranks[i].error, UnavailableError)]
            if died:
                failed = died
                first = gather.ranks[died[0]].error
        # (UnresponsiveError, the liveness watch's, already names every silent rank.)
        if isinstance(first, DeadlineExceededError) and not isinstance(first, UnresponsiveError):
            raise await self._deadline_error(gather, [c[0] for c in prepared], prepared[0][1],
                                             self._rt.call_timeout if timeout is None else timeout)
        if first is not None:
            # The lowest failed rank explains itself; the others keep their deadline.
            rank, name, _, _ = prepared[failed[0]]
            raise await self.convert(self._members.workers[rank], first, name) from None
        return gather.values()

    async def _stage(self, prepared: list, payloads: dict[int, Any]) -> str | None:
        """Put the large buffers of the payloads for same-host ranks into one staged segment
        (:mod:`podium.transport.shmstage`) when two or more ranks take one and together they
        reach the shared-memory threshold (each rank's shard may be below it: 16 MiB over 128
        ranks): the name (pinned), or None. Off the loop: it copies the batch."""
        if max(map(_NBYTES, payloads.values()), default=0) < REF_MIN_BYTES:
            return None  # most calls: nothing to stage (checked without a step per rank)
        workers = self._members.workers
        local: dict[int, Any] = {}  # the distinct payloads (a ONE_TO_ALL's ranks share one)
        ranks = sent = threshold = 0
        for i, (rank, _, _, _) in enumerate(prepared):
            payload = payloads[i]
            if payload.nbytes < REF_MIN_BYTES:
                continue
            client = workers[rank].client
            if client.same_host is True and client.segments is not None:
                local.setdefault(id(payload), payload)
                ranks += 1
                sent += payload.nbytes
                threshold = max(threshold, client.shm_threshold)
        if ranks < 2 or sent < threshold:
            return None
        try:
            return await asyncio.to_thread(STAGE.stage, list(local.values()), REF_MIN_BYTES)
        except OSError as exc:  # /dev/shm full: each rank's own segment, or TCP
            log.warning("cannot stage a group call's arguments in shared memory (%s)", exc)
            return None

    def _submit_all(self, prepared: list, payloads: dict[int, Any], hold: bool, sinks: list,
                    timeout: float | None = None, on_error: Callable | None = None, trace: int = 0) -> None:
        """Send every rank its call; each outcome settles its sink (no task or future per
        rank on the raw call path): ``sink.set_result(value)``, or ``on_error(sink, exc)``.
        By default (the PendingRefs of a ``blocking=False`` call) a broken worker's error is
        turned into WorkerDiedError first."""
        timeout = self._rt.call_timeout if timeout is None else timeout
        workers = self._members.workers
        failed = self._sink_failed if on_error is None else on_error
        for i, (rank, name, _, _) in enumerate(prepared):
            workers[rank].client.submit_into(name, payloads[i], sinks[i], failed, hold=hold, timeout=timeout,
                                             trace=trace)

    def _sink_failed(self, sink: PendingRef, exc: BaseException) -> None:
        """A ``blocking=False`` call failed: settle its ref with the error a user can act on
        (on the loop thread)."""
        worker = self._members.workers[sink.rank]
        if isinstance(exc, UnavailableError) and not isinstance(exc, WorkerDiedError) and not self.closed:
            async def fail() -> None:  # asks the scheduler how the worker ended
                sink.set_exception(await self.convert(worker, exc, sink.method))
            asyncio.get_running_loop().create_task(fail())
            return
        if isinstance(exc, RemoteError) and exc.rank < 0:
            exc.rank = worker.rank
        if isinstance(exc, (WorkerDiedError, UnresponsiveError)) and not self.closed:
            self._members.dead.add(worker.rank)
        self._rendezvous_failed(worker, exc)
        sink.set_exception(exc)

    async def _deadline_error(self, gather: GroupGather, ranks: list[int], method: str,
                              timeout: float | None) -> DeadlineExceededError:
        """One DeadlineExceededError naming every rank that did not answer in time.

        The ranks of one call share its deadline, so the others expire within moments of
        the first: wait that long, then list each rank still silent (``err.ranks``)."""
        await gather.all_settled(_DEADLINE_GRACE_SECONDS)
        late = [rank for rank, outcome in zip(ranks, gather.ranks)
                if not outcome.settled or isinstance(outcome.error, DeadlineExceededError)]
        answered = len(ranks) - len(late)
        err = DeadlineExceededError(
            f"{method} did not finish within {f'{timeout:g}s' if timeout else 'its deadline'}: rank{'s' if len(late) > 1 else ''} "
            f"{late if len(late) > 1 else late[0]} did not answer ({answered} of {len(ranks)} did); "
            f"a stopped or hung process, or a call that needs a longer call_timeout",
            rank=late[0])
        #: Every rank that did not answer, in rank order.
        err.ranks = late  # type: ignore[attr-defined]  # read by callers that list the silent ranks
        return err

    async def convert(self, worker: WorkerHandle, exc: BaseException, what: str) -> BaseException:
        """Turn a broken stream into WorkerDiedError with the scheduler's exit record (and
        note the rank dead in the members)."""
        out = await self._convert(worker, exc, what)
        if isinstance(out, (WorkerDiedError, UnresponsiveError)) and not self.closed:
            self._members.dead.add(worker.rank)
        self._rendezvous_failed(worker, out)
        return out

    def _rendezvous_failed(self, worker: WorkerHandle, exc: BaseException) -> None:
        """A rank's rendezvous failed: the group is broken, and the calls the other ranks
        have in flight (waiting in that rendezvous) fail now with the reason. The failed rank
        counts as dead too: torch's state in it is half made (a failed init_process_group
        leaves its group counter advanced, so its next rendezvous uses keys no peer writes)."""
        if self.closed or not isinstance(exc, RemoteError) or exc.remote_type not in _RENDEZVOUS_ERRORS:
            return
        reason = f"rank {worker.rank}'s rendezvous failed ({exc.remote_type}: {exc.message.splitlines()[0]})"
        self._members.broken = reason
        self._members.dead.add(worker.rank)
        for other in self._members.workers:
            if other is not worker and other.client is not None and other.client.pending:
                other.client.fail_pending(FailedPreconditionError(
                    f"WorkerGroup {self.label!r}: {reason}; rank {other.rank} waited in the same rendezvous",
                    rank=other.rank))

    async def _convert(self, worker: WorkerHandle, exc: BaseException, what: str) -> BaseException:
        if isinstance(exc, WorkerDiedError) or not isinstance(exc, UnavailableError) or self.closed:
            if isinstance(exc, RemoteError) and exc.rank < 0:
                exc.rank = worker.rank
            return exc
        from podium.v1 import common_pb2
        deadline = time.monotonic() + _DEATH_LOOKUP_SECONDS
        info = None
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                infos = await self._rt.scheduler.get_workers(ids=[worker.worker_id])
                if infos and infos[0].state in (common_pb2.WORKER_EXITED, common_pb2.WORKER_FAILED):
                    info = infos[0]
                    break
            await asyncio.sleep(0.1)
        if info is None:
            # No exit record yet: the worker's own agent would have reported a plain death at
            # once, so its node agent is gone too, or the network to it is (the scheduler
            # only calls the node dead when its lease runs out).
            return WorkerDiedError(
                f"worker rank {worker.rank} ({worker.name}) at {worker.address} on node "
                f"{worker.info.node_id} stopped answering during {what}: {exc}; the scheduler has no "
                f"exit record after {_DEATH_LOOKUP_SECONDS:g} s, so its node agent died or the node "
                f"is cut off (`podium status` shows the node DEAD once its lease runs out)",
                rank=worker.rank, node=worker.info.node_id)
        return died_error(info, worker.rank, worker.name, what)
