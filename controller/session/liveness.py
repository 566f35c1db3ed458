"""Ranks that stop answering while calls wait on them: found without the call's deadline.

A worker stopped with SIGSTOP, deadlocked, or on a machine that froze closes no socket,
so its pending calls would wait for their deadline (an hour by default) while the other
ranks of a data-parallel step wait on it inside their collectives. So, while a watched
worker has calls in flight, the controller pings it every ``silence / 5`` seconds on a
connection of its own (the gRPC health service, answered by the worker's I/O loop
thread, which runs while user code runs in its execution thread, even code that holds
the GIL in pure Python: the interpreter hands the GIL over every few milliseconds). A
rank that answers no ping for ``silence`` seconds (``PODIUM_LIVENESS_SECONDS``, default
10; 0 turns it off) fails its pending calls with :class:`~podium.errors.UnresponsiveError`
listing every silent rank with its node, pid and how long it has been silent, and the last
stacks that could be had (:mod:`podium.workerstacks`: a stopped rank cannot answer, so its
/proc state from its node agent stands in; ``UnresponsiveError.stacks``). Those take up to
``STACKS_SECONDS`` to gather, so they are fetched once a rank has been silent for most of the
bound, and the calls fail at the bound itself; every busy rank is pinged at once, so 256 ranks
cost one bound like one rank does. A method
that runs for hours in a live process is never cut short: its process keeps answering.
An ``async`` method of a WorkerGroup's worker that blocks its worker's event loop
(``time.sleep`` in ``async def``) does stop the answers, and is reported like a hung rank;
an async ``ray`` actor's methods and ``async def __init__`` run on loops of their own
(:class:`podium.worker.actorshell.GroupLoop`), so blocking them does not, as in Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import weakref
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from podium import rpc
from podium.errors import UnresponsiveError
from podium.workerstacks import collect_from, first_lines


if TYPE_CHECKING:
    from podium.controller.session.core import SessionCore

__all__ = ["Liveness", "DEFAULT_SILENCE_SECONDS"]

log = logging.getLogger("podium.controller")

#: Seconds without an answer after which a busy rank's calls fail (0: never).
DEFAULT_SILENCE_SECONDS = float(os.environ.get("PODIUM_LIVENESS_SECONDS") or 10.0)
#: How long a silent rank (and its agent) may take to give its stacks before its calls fail.
STACKS_SECONDS = 2.0
#: Lines of each silent rank's stacks in the error's message (the attribute has them all).
STACK_LINES = 15


class Liveness:
    """Pings the busy workers of one runtime and fails the calls of silent ones."""

    def __init__(self, runtime: SessionCore, silence: float = DEFAULT_SILENCE_SECONDS) -> None:
        self._runtime = runtime
        #: Seconds of silence that fail a busy rank's calls (0: off).
        self.silence = silence
        #: worker id -> its WorkerClient (weak: a group dropped without shutdown drops out).
        self._clients: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
        #: worker id -> (channel, health stub): a connection of its own, so that a large
        #: payload on the call connection never delays a ping.
        self._channels: dict[str, tuple[Any, Any]] = {}
        #: worker id -> loop time of its last answer (or of when it became busy).
        self._heard: dict[str, float] = {}
        self._pinging: dict[str, asyncio.Task] = {}
        #: worker id -> why its last ping got no answer (for the error message).
        self._last_error: dict[str, str] = {}
        self._task: asyncio.Task | None = None
        #: The stacks of ranks silent for most of the bound, fetched before it runs out so that
        #: failing them waits for nothing: (loop time started, worker ids, the fetch), or None.
        self._early: tuple[float, frozenset[str], asyncio.Task] | None = None
        #: How many silent ranks it failed (tests and stats).
        self.found = 0

    def watch(self, worker_id: str, client: Any) -> None:
        """Watch one worker (call on the runtime's loop)."""
        if self.silence <= 0:
            return
        self._clients[worker_id] = client
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def forget(self, worker_ids: list[str]) -> None:
        """Stop watching these workers; the watch ends with the last one."""
        for worker_id in worker_ids:
            self._clients.pop(worker_id, None)
            self._drop(worker_id)
        if not self._clients and self._task is not None:
            self._task.cancel()
            self._task = None

    def _drop(self, worker_id: str) -> None:
        self._heard.pop(worker_id, None)
        self._last_error.pop(worker_id, None)
        task = self._pinging.pop(worker_id, None)
        if task is not None:
            task.cancel()
        held = self._channels.pop(worker_id, None)
        if held is not None:
            asyncio.get_running_loop().create_task(held[0].close())

    async def _run(self) -> None:
        try:
            await self._watch()
        finally:  # the watch ended (nothing watched, or the runtime closed): no channel stays
            for worker_id in list(self._channels):
                self._drop(worker_id)
            if self._early is not None:
                self._early[2].cancel()
                self._early = None

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        interval = max(0.02, self.silence / 5)
        # Silent this long (at least half the bound: several pings missed), a rank's stacks
        # are fetched ahead, so they are in hand when the bound runs out.
        early = max(self.silence / 2, self.silence - STACKS_SECONDS - interval)
        while self._clients and not self._runtime.closed:
            await asyncio.sleep(interval)
            now = loop.time()
            busy = {wid: c for wid, c in list(self._clients.items()) if c.pending and c.broken is None}
            for worker_id in [w for w in self._heard if w not in busy]:
                del self._heard[worker_id]  # idle again: its silence counts afresh next time
            silent, suspects = [], []
            for worker_id, client in busy.items():
                heard = self._heard.setdefault(worker_id, now)
                if now - heard > self.silence:
                    silent.append((worker_id, client, now - heard))
                    continue
                if now - heard > early:
                    suspects.append(worker_id)
                if worker_id not in self._pinging:
                    self._pinging[worker_id] = loop.create_task(self._ping(worker_id, client, interval))
            if suspects and (self._early is None or not self._early[1].issuperset(suspects)):
                if self._early is not None:
                    self._early[2].cancel()
                ids = frozenset(suspects)
                self._early = (now, ids, loop.create_task(self._last_stacks(set(ids))))
            elif not suspects and not silent and self._early is not None:
                self._early[2].cancel()  # they answered again
                self._early = None
            if silent:
                await self._fail(silent)

    async def _ping(self, worker_id: str, client: Any, interval: float) -> None:
        try:
            held = self._channels.get(worker_id)
            if held is None:
                channel = rpc.make_channel(client.address, self._runtime.token, self._runtime.tls)
                held = self._channels[worker_id] = (channel, health_pb2_grpc.HealthStub(channel))
            try:
                # A late answer still proves the process alive: each ping may take the whole bound.
                await held[1].Check(health_pb2.HealthCheckRequest(), timeout=max(self.silence, 1.0))
            except grpc.RpcError as exc:  # no answer: the silence goes on
                self._last_error[worker_id] = f"{exc.code().name}: {exc.details()}"
            except Exception as exc:  # noqa: BLE001 - likewise
                self._last_error[worker_id] = f"{type(exc).__name__}: {exc}"
            else:
                self._last_error.pop(worker_id, None)
                if worker_id in self._heard:
                    self._heard[worker_id] = asyncio.get_running_loop().time()
        finally:
            self._pinging.pop(worker_id, None)

    async def _last_stacks(self, silent_ids: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(worker id -> WorkerInfo, worker id -> WorkerStacks) of the silent workers, as far as
        the scheduler and their agents answer in time (a stopped rank has only its /proc state)."""
        state = await asyncio.wait_for(self._runtime.scheduler.cluster_state(), 5.0)
        infos = {w.id: w for w in state.workers if w.id in silent_ids}
        found: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            report = await collect_from(state, list(infos.values()), self._runtime.token, self._runtime.tls,
                                        timeout=STACKS_SECONDS)
            found = {r.worker_id: r for r in report}
        return infos, found

    async def _fail(self, silent: list[tuple[str, Any, float]]) -> None:
        infos: dict[str, Any] = {}
        stacks: dict[str, Any] = {}
        ids = {w for w, _, _ in silent}
        early, self._early = self._early, None
        if early is not None and early[1] >= ids and asyncio.get_running_loop().time() - early[0] <= self.silence:
            with contextlib.suppress(Exception):  # fetched ahead (see _watch): at most its rest to wait
                infos, stacks = await early[2]
        elif early is not None:
            early[2].cancel()
        if not ids <= infos.keys():
            with contextlib.suppress(Exception):  # where they run, if the scheduler answers in time
                infos, stacks = await self._last_stacks(ids)
        silent.sort(key=lambda item: item[1].rank)
        parts = []
        for worker_id, client, quiet in silent:
            info = infos.get(worker_id)
            where = (f"{info.spec.name} on node {info.node_id} ({info.node_address}), pid {info.pid}"
                     if info is not None else f"at {client.address}")
            last = self._last_error.get(worker_id, "")
            parts.append(f"rank {client.rank} ({where}) silent for {quiet:.1f} s"
                         + (f" (last ping: {last[:200]})" if last else ""))
        ranks = [client.rank for _, client, _ in silent]
        details = {"ranks": ",".join(map(str, ranks))}
        shown = []
        for worker_id, client, _ in silent:
            if worker_id in stacks:
                details[f"stacks.{client.rank}"] = str(stacks[worker_id])
                shown.append(first_lines(stacks[worker_id], STACK_LINES))
        err = UnresponsiveError(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped answering "
            f"while calls waited on {'them' if len(ranks) > 1 else 'it'}: {'; '.join(parts)}. "
            f"A stopped (SIGSTOP), deadlocked or frozen process; its pending calls are failed "
            f"after {self.silence:g} s of silence (PODIUM_LIVENESS_SECONDS)"
            + ("\nlast stacks (err.stacks has them whole):\n" + "\n".join(shown) if shown else ""),
            rank=ranks[0], node=infos[silent[0][0]].node_id if silent[0][0] in infos else "",
            details=details)
        log.warning("%s", err)
        for worker_id, client, _ in silent:
            if client.broken is None:
                self.found += 1
                client.fail_pending(err)
            self._drop(worker_id)
