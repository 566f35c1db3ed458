"""Binding and running a WorkerGroup's calls: the bound method of each ``@register``'ed
method (dispatch -> execute -> collect), the concurrent calls to the ranks (blocking, or
``blocking=False`` with PendingRefs), deadlines, and turning broken streams into
WorkerDiedError. A mixin of :class:`podium.controller.group.WorkerGroup`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from podium.controller.groupstate import GroupState
from podium.controller import dispatch as _dispatch
from podium.controller.calltimeout import effective_call_timeout
from podium.controller.deathwatch import died_error
from podium.controller.futures import PendingRef, is_pending, resolve_args
from podium.controller.gather import GroupGather, RankOutcome
from podium.controller.groupworkers import WorkerHandle, _no_arguments
from podium.controller.loopqueue import soon
from podium.controller.objects import owned_refs_in
from podium.transport.shmpool import REF_MIN_BYTES
from podium.transport.shmstage import STAGE
from podium.errors import (DeadlineExceededError, PodiumError, RemoteError, UnavailableError, UnresponsiveError,
                           WorkerDiedError)
from podium.worker.decorator import MAGIC_ATTR, get_registration
from podium.worker.factory import by_value

if TYPE_CHECKING:
    from podium.controller.group import WorkerGroup

__all__ = ["GroupCalls", "func_generator"]

log = logging.getLogger("podium.controller")

#: How long to poll the scheduler for a dead worker's exit record.
_DEATH_LOOKUP_SECONDS = 5.0
#: After one rank's deadline, how long the others (same deadline) get to answer or expire.
_DEADLINE_GRACE_SECONDS = 1.0


def func_generator(self: "WorkerGroup", method_name: str, dispatch_fn: Callable, collect_fn: Callable,
                   execute_fn: Callable, blocking: bool) -> Callable:
    """The bound method: an instance of a class named after ``method_name`` (for observability)."""
    rank_zero = getattr(execute_fn, "__name__", "") == "execute_rank_zero"
    replicated = dispatch_fn is not _dispatch.dispatch_all_to_all
    one_to_all = dispatch_fn is _dispatch.dispatch_one_to_all

    def __call__(this, *args: Any, **kwargs: Any) -> Any:
        if one_to_all and not rank_zero:
            # Every rank gets the very same arguments: one (args, kwargs) for all, encoded
            # once, without building and slicing N-long lists per argument (what
            # dispatch_one_to_all + slice_for_ranks would give, at O(N) Python per call).
            output = self._run(list(range(self.world_size)), method_name,
                               [(args, kwargs)] * self.world_size, blocking)
            return collect_fn(self, output)
        args, kwargs = dispatch_fn(self, *args, **kwargs)
        padding_count = kwargs.pop(_dispatch.PADDING_SIZE_KEY, 0)
        padded_rows = kwargs.pop(_dispatch.PADDED_ROWS_KEY, None)
        if rank_zero:
            if replicated:
                args, kwargs = _dispatch.slice_for_ranks(self.world_size, args, kwargs)[0]
            output = self._run([0], method_name, [(tuple(args), dict(kwargs))], blocking)[0]
        else:
            output = self._run(list(range(self.world_size)), method_name,
                               _dispatch.slice_for_ranks(self.world_size, args, kwargs), blocking)
        output = collect_fn(self, output)
        return _dispatch.unpad_output(output, padding_count, padded_rows, self.world_size)

    cls = type(method_name, (), {"__call__": __call__,
                                 "__doc__": f"WorkerGroup method {method_name!r} (dispatch -> execute -> collect)."})
    return cls()


def _keep_until_done(owned: Any, _ref: Any) -> None:
    """A done-callback whose only job is to hold ``owned`` (put values) until the call ends."""


class GroupCalls(GroupState):
    """How a WorkerGroup binds and runs calls (see the module docstring)."""

    def _bind_worker_method(self, user_defined_cls: Any, func_generator: Callable = func_generator) -> list[str]:
        """Put a bound method on the group for every registered method of the class (verl's
        ``_bind_worker_method``: ``dir()`` order, ``MAGIC_ATTR``)."""
        user_defined_cls = getattr(user_defined_cls, "__ray_actor_class__", user_defined_cls)
        names = []
        for name in dir(user_defined_cls):
            try:
                method = getattr(user_defined_cls, name)
            except Exception:
                continue
            if not callable(method) or not hasattr(method, MAGIC_ATTR):
                continue
            reg = get_registration(method)
            assert reg is not None  # it has MAGIC_ATTR
            dispatch_mode, execute_mode = reg["dispatch_mode"], reg["execute_mode"]
            _dispatch._check_dispatch_mode(dispatch_mode)
            _dispatch._check_execute_mode(execute_mode)
            dispatch_fn, collect_fn = _dispatch.resolve_dispatch_mode(dispatch_mode)
            execute_fn = getattr(self, _dispatch.get_predefined_execute_fn(execute_mode)["execute_fn_name"])
            try:
                setattr(self, name, func_generator(self, name, dispatch_fn=dispatch_fn, collect_fn=collect_fn,
                                                   execute_fn=execute_fn, blocking=reg["blocking"]))
            except Exception as exc:
                raise ValueError(f"Fail to set method_name {name}") from exc
            names.append(name)
        return names

    def _remote(self, method_name: str, args: tuple) -> tuple[str, tuple]:
        # Fused views route role methods through the fused worker's dispatcher.
        if self.fused_worker_used and self.sub_cls_name and method_name not in self.method_names_of_class():
            assert self.ray_cls_with_init is not None  # a fused view has its class
            cls = self.ray_cls_with_init.cls
            role_cls = getattr(cls, "raw_cls_dict", {}).get(self.sub_cls_name)
            target = getattr(role_cls, method_name, None)
            fn = "_fuw_execute_async" if asyncio.iscoroutinefunction(target) else self.fused_worker_execute_fn_name
            return fn, (f"{self.sub_cls_name}_fwmn_{method_name}",) + tuple(args)
        return method_name, tuple(args)

    def method_names_of_class(self) -> set[str]:
        """Names the hosted class itself has (not routed through a fused role)."""
        return set(dir(self.ray_cls_with_init.cls)) if self.ray_cls_with_init is not None else set()

    def _run(self, ranks: list[int], method_name: str, per_rank: list[tuple[tuple, dict]], blocking: bool) -> list:
        """Call ``method_name`` on ``ranks`` concurrently: values when blocking, else PendingRefs."""
        if self._closed:
            raise PodiumError(f"WorkerGroup {self.name_prefix!r} is shut down")
        rt = self._rt
        calls = []
        last: Any = None
        for rank, entry in zip(ranks, per_rank):
            if entry is not last:  # ONE_TO_ALL's ranks share one entry: prepared once
                last = entry
                name, args = self._remote(method_name, entry[0])
                kwargs = entry[1]
            calls.append((rank, name, args, kwargs))
        timeout = effective_call_timeout(rt.call_timeout)  # a `with call_timeout(s):` block's
        if blocking:
            return rt.run(self._call_all(calls, hold=False, timeout=timeout), timeout=timeout + 10,
                          what=f"{method_name} on {len(ranks)} ranks")
        workers = self._workers
        # A held result lives in its worker until nothing here can name it any more: each
        # ref releases it when it is garbage (PendingRef.__del__).
        refs = [PendingRef(rank, method_name, workers[rank].held_releaser(rt)) for rank, *_ in calls]
        owned = owned_refs_in(per_rank)
        if owned:  # put() values the call reads live until it finished
            keep_alive = functools.partial(_keep_until_done, owned)
            for ref in refs:
                ref.add_done_callback(keep_alive)
        soon(rt.loop, self._start_nowait, calls, refs, timeout)  # batched: one loop wake-up per burst
        return refs

    def _start_nowait(self, calls: list, sinks: list[PendingRef], timeout: float | None = None) -> None:
        """Start a ``blocking=False`` call on the loop thread; results settle ``sinks``."""
        if any(is_pending(v) for _, _, args, kwargs in calls for v in (*args, *kwargs.values())):
            # Arguments that are still computing: wait for them in a task.
            asyncio.get_running_loop().create_task(self._call_all(calls, hold=True, sinks=sinks,
                                                                  timeout=timeout))
            return
        try:
            payloads = self._payloads(calls)
        except BaseException as exc:  # noqa: BLE001 - reported through every rank's ref
            for sink in sinks:
                sink._set_exception(exc)
            return
        self._submit_all(calls, payloads, True, sinks, timeout)

    @staticmethod
    def _payloads(prepared: list) -> dict[int, Any]:
        """The encoded payload of each call; ranks given the very same objects share one."""
        from podium.worker.client import prepare
        groups = _dispatch.unique_payload_groups([(a, k) for _, _, a, k in prepared])
        payloads: dict[int, Any] = {}
        for members in groups:
            _, _, args, kwargs = prepared[members[0]]
            if not args and not kwargs:
                payload = _no_arguments()
            else:
                funcs = [v for v in (*args, *kwargs.values()) if callable(v)]
                with by_value(*funcs):
                    payload = prepare((tuple(args), dict(kwargs)))
            for i in members:
                payloads[i] = payload
        return payloads

    async def _call_all(self, calls: list, hold: bool, sinks: list | None = None,
                        timeout: float | None = None) -> list:
        try:
            prepared = []
            last: Any = None
            for rank, name, args, kwargs in calls:
                if last is None or args is not last[0] or kwargs is not last[1]:
                    last = (args, kwargs)  # ranks sharing their arguments share the resolved ones
                    resolved = await resolve_args(args, kwargs)
                prepared.append((rank, name, *resolved))
            payloads = self._payloads(prepared)
        except BaseException as exc:
            if sinks is None:
                raise
            for sink in sinks:
                sink._set_exception(exc)
            return []
        staged = await self._stage(prepared, payloads)
        gather = None
        try:
            if sinks is not None:
                self._submit_all(prepared, payloads, hold, sinks, timeout)
            else:  # a blocking call's outcomes land in the slots of one gather: no future per rank
                gather = GroupGather(len(prepared))
                self._submit_all(prepared, payloads, hold, gather.ranks, timeout, RankOutcome.fail)
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
        # (UnresponsiveError, the liveness watch's, already names every silent rank.)
        if isinstance(first, DeadlineExceededError) and not isinstance(first, UnresponsiveError):
            raise await self._deadline_error(gather, [c[0] for c in prepared], prepared[0][1],
                                             self._rt.call_timeout if timeout is None else timeout)
        if first is not None:
            # The lowest failed rank explains itself; the others keep their deadline.
            rank, name, _, _ = prepared[failed[0]]
            raise await self._convert(self._workers[rank], first, name) from None
        return gather.values()

    async def _stage(self, prepared: list, payloads: dict[int, Any]) -> str | None:
        """Put the large buffers of the payloads for same-host ranks into one staged segment
        (:mod:`podium.transport.shmstage`) when two or more ranks take one and together they
        reach the shared-memory threshold (each rank's shard may be below it: 16 MiB over 128
        ranks): the name (pinned), or None. Off the loop: it copies the batch."""
        workers = self._workers
        local: dict[int, Any] = {}  # the distinct payloads (a ONE_TO_ALL's ranks share one)
        ranks = sent = threshold = 0
        for i, (rank, _, _, _) in enumerate(prepared):
            payload = payloads[i]
            if payload.nbytes < REF_MIN_BYTES:  # most calls: nothing to stage, checked first
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
                    timeout: float | None = None, on_error: Callable | None = None) -> None:
        """Send every rank its call; each outcome settles its sink (no task or future per
        rank on the raw call path): ``sink._set_result(value)``, or ``on_error(sink, exc)``.
        By default (the PendingRefs of a ``blocking=False`` call) a broken worker's error is
        turned into WorkerDiedError first."""
        timeout = self._rt.call_timeout if timeout is None else timeout
        workers = self._workers
        failed = self._sink_failed if on_error is None else on_error
        for i, (rank, name, _, _) in enumerate(prepared):
            workers[rank].client.submit_into(name, payloads[i], sinks[i], failed, hold=hold, timeout=timeout)

    def _sink_failed(self, sink: PendingRef, exc: BaseException) -> None:
        """A ``blocking=False`` call failed: settle its ref with the error a user can act on
        (on the loop thread)."""
        worker = self._workers[sink.rank]
        if isinstance(exc, UnavailableError) and not isinstance(exc, WorkerDiedError) and not self._closed:
            async def fail() -> None:  # asks the scheduler how the worker ended
                sink._set_exception(await self._convert(worker, exc, sink.method))
            asyncio.get_running_loop().create_task(fail())
            return
        if isinstance(exc, RemoteError) and exc.rank < 0:
            exc.rank = worker.rank
        sink._set_exception(exc)

    async def _deadline_error(self, gather: GroupGather, ranks: list[int], method: str,
                              timeout: float) -> DeadlineExceededError:
        """One DeadlineExceededError naming every rank that did not answer in time.

        The ranks of one call share its deadline, so the others expire within moments of
        the first: wait that long, then list each rank still silent (``err.ranks``)."""
        await gather.all_settled(_DEADLINE_GRACE_SECONDS)
        late = [rank for rank, outcome in zip(ranks, gather.ranks)
                if not outcome.settled or isinstance(outcome.error, DeadlineExceededError)]
        answered = len(ranks) - len(late)
        err = DeadlineExceededError(
            f"{method} did not finish within {timeout:g}s: rank{'s' if len(late) > 1 else ''} "
            f"{late if len(late) > 1 else late[0]} did not answer ({answered} of {len(ranks)} did); "
            f"a stopped or hung process, or a call that needs a longer call_timeout",
            rank=late[0])
        #: Every rank that did not answer, in rank order.
        err.ranks = late  # type: ignore[attr-defined]  # read by callers that list the silent ranks
        return err

    async def _convert(self, worker: WorkerHandle, exc: BaseException, what: str) -> BaseException:
        """Turn a broken stream into WorkerDiedError with the scheduler's exit record."""
        if isinstance(exc, WorkerDiedError) or not isinstance(exc, UnavailableError) or self._closed:
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
