"""``RolloutServerManager``: the client side of a pool of rollout replicas (verl's
``LLMServerManager`` shape).

It holds one :class:`~podium.rollout.server.RolloutServer` actor per replica and:

* **balances by load**: each request goes to the replica with the fewest requests in flight
  from this manager (ties: the one used least recently), at most ``max_requests`` per
  replica; :meth:`generate` blocks, :meth:`submit` returns a future;
* **runs weight updates** (:meth:`update_weights`): new requests are held back, every replica
  aborts or drains its requests in flight (the ``policy``), the trainer's weights go down the
  broadcast (:mod:`podium.rollout.weights`, the chain by default) into every replica's vLLM, then requests
  flow again, on the new policy version.

An aborted request raises :class:`~podium.errors.AbortedError` whose ``details`` name the
request and the replica; the caller decides whether to resubmit it. A replica whose process
died, or that stopped answering, leaves the rotation (:attr:`RolloutServerManager.dropped`
says why) and the others serve on; it is replaced, and its replacement rejoins once it holds
the current weights (:mod:`podium.rollout.serverheal`). A replica that an update did not
reach gets the update again. Every answer comes from the current policy version.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import podium.errors as errors
from podium.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    PodiumError,
    RemoteError,
    UnavailableError,
    WeightBroadcastError,
    WorkerDiedError,
)
from podium.rollout.config import RolloutConfig
from podium.rollout.server import CONTROL_THREADS, UPDATE_POLICIES, RolloutServer, check_seconds
from podium.rollout.serverheal import MAX_STANDBYS, ReplicaHealer
from podium.rollout.weights.carrier import carrier_named
from podium.rollout.weights.driver import Replicas, Source, UpdateOutcome, drive_update
from podium.rollout.weights.plan import DEFAULT_BUCKET_BYTES

__all__ = ["RolloutServerManager", "MAX_REPLICAS"]

#: Most replicas one manager drives.
MAX_REPLICAS = 256


def _typed(exc: BaseException, **details: str) -> BaseException:
    """A replica's error as the Podium error it was raised as (an AbortedError stays one
    across the process boundary), with ``details`` added (the request and replica, which the
    remote error's own details do not carry across); others unchanged."""
    if isinstance(exc, RemoteError) and exc.remote_type:
        cls = getattr(errors, exc.remote_type.rsplit(".", 1)[-1], None)
        if isinstance(cls, type) and issubclass(cls, PodiumError) and cls is not RemoteError:
            merged = {k: v for k, v in exc.details.items() if k != "remote_type"}
            merged.update(details)
            return cls(exc.message, details=merged)
    return exc


def _check_max_requests(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
        raise InvalidArgumentError(f"max_requests must be an int in [1, 1024], got {value!r}")


class RolloutServerManager:
    """Load-balanced generation over rollout replicas, and their weight updates.

    Build it with :meth:`launch` (starts the actors and their engines) or from existing
    ``replicas`` (actor handles of :class:`RolloutServer`) and their ``names``.
    """

    def __init__(self, replicas: list[Any], names: list[str], max_requests: int = 8,
                 spawn: Callable[[int], Any] | None = None, standbys: list[Any] | None = None,
                 health_interval: float = 1.0, probe_timeout: float = 10.0) -> None:
        if not replicas or len(replicas) != len(names) or len(replicas) > MAX_REPLICAS:
            raise InvalidArgumentError(f"need 1..{MAX_REPLICAS} replicas, one name each; got {len(replicas)} "
                                       f"replicas and {len(names)} names")
        _check_max_requests(max_requests)
        self.replicas, self.names = list(replicas), list(names)
        self.max_requests = max_requests
        self.version = 0
        self._cond = threading.Condition()
        self._load = [0] * len(replicas)  # requests in flight per replica, from this manager
        self._last_used = [0] * len(replicas)
        self._tick = itertools.count(1)
        self._ids = itertools.count()
        self._updating = False
        #: Why each replica left the rotation (absent: it serves). A replica leaves when its
        #: process died, or when an update left it without the new weights: it must not
        #: answer with a policy older than the others.
        self.dropped: dict[str, str] = {}
        self._dropped_at: dict[str, float] = {}
        # Held by an update and by a newcomer's catch-up: weights move one update at a time.
        self._update_lock = threading.Lock()
        #: The last update's (source, timeout, bucket_bytes, carrier): a newcomer catches up from it.
        self._last: tuple[Any, float, int, str] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(len(replicas) * max_requests,
                                                           thread_name_prefix="podium-rollout-client")
        #: Replaces replicas that died or stopped answering (see :mod:`podium.rollout.serverheal`).
        self.healer = ReplicaHealer(self, spawn, list(standbys or []), health_interval, probe_timeout)
        if self.healer.active:
            self.healer.start()

    @classmethod
    def launch(cls, config: RolloutConfig | dict, replicas: int = 2, max_requests: int = 8,
               name_prefix: str = "rollout", num_cpus: float = 1.0, timeout: float = 600.0,
               server_cls: type = RolloutServer, standby: int = 0, replace: bool = True,
               health_interval: float = 1.0, probe_timeout: float = 10.0) -> RolloutServerManager:
        """Start ``replicas`` :class:`RolloutServer` actors (each holding ``max_requests``
        requests at once, on ``max_requests`` + a few control threads) and build their engines
        in parallel. ``server_cls`` may be a subclass that adds methods (metrics, hooks).

        ``standby`` more are started outside the rotation; with ``replace``, a replica that
        dies or stops answering a probe (every ``health_interval`` s, within ``probe_timeout``)
        is replaced by a standby, or by a new one once none is left (:mod:`podium.rollout.serverheal`)."""
        import podium

        if not (isinstance(server_cls, type) and issubclass(server_cls, RolloutServer)):
            raise InvalidArgumentError(f"server_cls must be RolloutServer or a subclass, got {server_cls!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
            raise InvalidArgumentError(f"replicas must be an int in [1, {MAX_REPLICAS}], got {replicas!r}")
        _check_max_requests(max_requests)
        if isinstance(standby, bool) or not isinstance(standby, int) or not 0 <= standby <= MAX_STANDBYS:
            raise InvalidArgumentError(f"standby must be an int in [0, {MAX_STANDBYS}], got {standby!r}")
        timeout = check_seconds(timeout, "timeout")
        config = RolloutConfig.from_value(config)
        actor_cls = podium.remote(server_cls).options(max_concurrency=max_requests + CONTROL_THREADS,
                                                       num_cpus=num_cpus)
        names = [f"{name_prefix}-{i}" for i in range(replicas)]
        # Replica i samples with seed + i: replicas must not return the same samples.
        handles = [actor_cls.remote(config, name=name, max_requests=max_requests, seed=config.seed + i)
                   for i, name in enumerate(names)]
        spares = [actor_cls.remote(config, name=f"{name_prefix}-standby-{j}", max_requests=max_requests,
                                   seed=config.seed + replicas + j) for j in range(standby)]
        try:
            podium.get([h.start.remote() for h in [*handles, *spares]], timeout=timeout)
        except BaseException:
            for h in [*handles, *spares]:  # no half-started pool left holding processes
                podium.kill(h)
            raise

        def spawn(slot: int) -> Any:
            handle = actor_cls.remote(config, name=names[slot], max_requests=max_requests, seed=config.seed + slot)
            try:
                handle.start.remote().get(timeout=timeout)
            except BaseException:
                podium.kill(handle)
                raise
            return handle

        return cls(handles, names, max_requests, spawn=spawn if replace else None, standbys=spares,
                   health_interval=health_interval, probe_timeout=probe_timeout)

    # ------------------------------------------------------------------ requests

    def load(self) -> list[int]:
        """Requests in flight per replica (sent by this manager, not yet answered)."""
        with self._cond:
            return list(self._load)

    def _acquire(self, deadline: float) -> int:
        with self._cond:
            while True:
                if not self._updating:
                    serving = self._serving()
                    if not serving:
                        raise UnavailableError(f"no rollout replica is serving: {self.dropped}")
                    free = [i for i in serving if self._load[i] < self.max_requests]
                    if free:
                        best = min(free, key=lambda i: (self._load[i], self._last_used[i]))
                        self._load[best] += 1
                        self._last_used[best] = next(self._tick)
                        return best
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceededError("no replica could take the request before its deadline "
                                                + ("(a weight update was running)" if self._updating else
                                                   f"(all at {self.max_requests} requests)"))
                self._cond.wait(left)

    def _serving(self) -> list[int]:
        return [i for i, name in enumerate(self.names) if name not in self.dropped]

    def serving(self) -> list[str]:
        """The replicas requests go to (the others are in :attr:`dropped`, with why)."""
        with self._cond:
            return [self.names[i] for i in self._serving()]

    def _drop(self, replica: int, why: str, handle: Any = None) -> None:
        """Take slot ``replica`` out of the rotation, saying ``why`` (the first reason stays);
        with ``handle``, only while the slot still holds that replica (not its replacement)."""
        with self._cond:
            if handle is not None and self.replicas[replica] is not handle:
                return
            name = self.names[replica]
            if name not in self.dropped:
                self.dropped[name] = why
                self._dropped_at[name] = time.monotonic()
            self._cond.notify_all()  # requests waiting for a slot re-check what is left

    # The healer's view (podium.rollout.serverheal).
    drop = _drop

    @property
    def updating(self) -> bool:
        """Whether a weight update is running."""
        return self._updating

    def serving_slots(self) -> list[int]:
        """Indices of the replicas in the rotation."""
        with self._cond:
            return self._serving()

    def dropped_slots(self) -> list[int]:
        """Indices of the replicas out of the rotation."""
        with self._cond:
            return [i for i, name in enumerate(self.names) if name in self.dropped]

    def dropped_since(self, name: str) -> tuple[str, float]:
        """Why the replica ``name`` left the rotation, and when (a monotonic time)."""
        with self._cond:
            return self.dropped.get(name, ""), self._dropped_at.get(name, time.monotonic())

    def install(self, slot: int, handle: Any) -> tuple[int, float]:
        """Put the started replica ``handle`` in slot ``slot`` once it holds the current
        weights (the last update's source sends them again, at the current version); the
        version it serves, and the seconds its catch-up took."""
        start = time.monotonic()
        with self._update_lock:
            version = self.version
            if version > 0:
                assert self._last is not None  # a version above 0 came with a source
                source, timeout, bucket_bytes, carrier = self._last
                handle.begin_update.remote("drain", timeout=timeout).get(timeout=timeout + 10)
                self._broadcast(source, version, timeout, bucket_bytes, [handle], carrier).conclude()
                handle.end_update.remote(version).get(timeout=timeout + 10)
            with self._cond:
                name = self.names[slot]
                self.replicas[slot] = handle
                self.dropped.pop(name, None)
                self._dropped_at.pop(name, None)
                self._cond.notify_all()
        return version, time.monotonic() - start

    def _release(self, replica: int) -> None:
        with self._cond:
            self._load[replica] -= 1
            self._cond.notify_all()

    def generate(self, prompt_ids: list[int], n: int | None = None, width: int | None = None, index: int = 0,
                 request_id: str | None = None, timeout: float = 300.0) -> Any:
        """``n`` samples of one prompt from the least-loaded replica: a DataProto of n rows
        (:meth:`RolloutServer.generate`'s fields, ``policy_version`` among them).

        Raises AbortedError (``details``: ``request_id``, ``replica``) when a weight update
        aborted it, DeadlineExceededError past ``timeout`` seconds."""
        timeout = check_seconds(timeout, "timeout")
        deadline = time.monotonic() + timeout
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        replica = self._acquire(deadline)
        handle = self.replicas[replica]
        try:
            ref = handle.generate.remote(rid, list(prompt_ids), n=n, width=width, index=index,
                                                         timeout=max(deadline - time.monotonic(), 1e-3))
            try:
                return ref.get(timeout=max(deadline - time.monotonic(), 0) + 10)
            except WorkerDiedError as exc:
                self._drop(replica, f"its process died: {exc.message}", handle)
                raise
            except PodiumError as exc:
                raise _typed(exc, request_id=rid, replica=self.names[replica]) from None
        finally:
            self._release(replica)

    def submit(self, prompt_ids: list[int], **kwargs: Any) -> concurrent.futures.Future:
        """:meth:`generate` on the manager's threads: a future of its result."""
        return self._pool.submit(self.generate, prompt_ids, **kwargs)

    # ------------------------------------------------------------------ weight updates

    def update_weights(self, source: Any, version: int, policy: str = "drain", timeout: float = 120.0,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, carrier: str = "chain") -> dict:
        """Move ``source``'s weights (a trainer role with ``broadcast_send``, as
        :class:`~podium.rollout.broadcastgroups.BroadcastSource` has) to every replica as
        policy ``version`` over ``carrier`` (``"chain"``; ``"nccl"`` / ``"gloo"`` with a source that
        has ``broadcast_open``); requests in flight are aborted or drained first (``policy``).

        Goes to the replicas in the rotation; one whose process died is left out (named in
        :attr:`dropped` and the result's ``dropped``, and replaced by the healer). A replica
        alive behind one that failed mid-update gets the same update again at once (named in
        ``caught_up``) and serves on. Returns ``{"version", "aborted", "drained", "wait_s",
        "broadcast_s", "dropped", "caught_up", "bytes", "tensors", "replicas"}``. Raises
        WeightBroadcastError when no replica took the update, or an alive one could not take
        it even again: the others run on the new version, such a one leaves the rotation
        (it holds the old weights) and is replaced. Requests flow again either way."""
        if policy not in UPDATE_POLICIES:
            raise InvalidArgumentError(f"policy must be one of {UPDATE_POLICIES}, got {policy!r}")
        if isinstance(version, bool) or not isinstance(version, int) or version <= self.version:
            raise InvalidArgumentError(f"version must be an int above the current {self.version}, got {version!r}")
        timeout = check_seconds(timeout, "timeout")
        carrier_named(carrier)
        with self._cond:
            if self._updating:
                raise errors.FailedPreconditionError("a weight update is already running")
            self._updating = True  # requests not yet sent wait here
        try:
            with self._update_lock:  # a newcomer's catch-up finishes first
                return self._update(source, version, policy, timeout, bucket_bytes, carrier)
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()

    def _update(self, source: Any, version: int, policy: str, timeout: float, bucket_bytes: int,
                carrier: str) -> dict:
        targets = self.serving_slots()
        if not targets:
            raise UnavailableError(f"no rollout replica is serving: {self.dropped}")
        start = time.monotonic()
        began: list[int] = []
        updated: list[int] = []
        caught_up: list[int] = []
        dropped_before = set(self.dropped)
        sent = False
        outcome = None
        try:
            begun = self._begin(targets, policy, timeout, began)
            wait_s = time.monotonic() - start
            sent = True
            outcome = self._broadcast(source, version, timeout, bucket_bytes, [self.replicas[i] for i in began],
                                      carrier)
            updated = [began[p] for p, out in enumerate(outcome.outcomes) if isinstance(out, dict)]
            missed = [i for i in began if i not in updated]
            if missed and outcome.sent is not None:  # the source works: a failure elsewhere cut them off
                caught_up = self._catch_up(missed, source, version, timeout, bucket_bytes, carrier)
        finally:
            new = set(updated) | set(caught_up)
            for i in began:  # without the new weights a replica would serve an old policy
                if i not in new:
                    self._drop(i, f"the update to version {version} did not reach it")
            if new:
                self.version = version
                self._last = (source, timeout, bucket_bytes, carrier)
            # Once weights were sent, a replica without them is retired (requests waiting at
            # its gate fail with AbortedError rather than run on an old policy) and replaced.
            # No weights sent (a begin failed): all reopen as they were.
            ends = [(i, self.replicas[i].retire.remote(self.dropped.get(self.names[i], "missed an update"))
                     if sent and i not in new else self.replicas[i].end_update.remote(version if i in new else None))
                    for i in began]
            for i, ref in ends:
                try:
                    ref.get(timeout=timeout + 10)
                except WorkerDiedError as exc:
                    self._drop(i, f"its process died: {exc.message}")
        assert outcome is not None
        if not new:
            outcome.conclude()  # raises WeightBroadcastError: nobody took it
        alive_missed = [i for i in began if i not in new and "died" not in self.dropped.get(self.names[i], "")]
        if alive_missed:
            names = [self.names[i] for i in alive_missed]
            raise WeightBroadcastError(
                f"weight update {version} did not reach {names} even when sent again; they left the rotation "
                f"and are replaced. New weights on {sorted(self.names[i] for i in new)}.",
                failed={n: self.dropped.get(n, "") for n in names}, updated=sorted(self.names[i] for i in new),
                kept=names)
        assert outcome.sent is not None
        seconds = time.monotonic() - start - wait_s
        return {"version": version, "aborted": sum(len(b["aborted"]) for b in begun),
                "drained": sum(b["drained"] for b in begun), "wait_s": wait_s, "broadcast_s": seconds,
                "dropped": sorted(set(self.dropped) - dropped_before),
                "caught_up": [self.names[i] for i in caught_up], "replicas": len(new),
                "bytes": outcome.sent["bytes"], "tensors": outcome.sent["tensors"]}

    def _catch_up(self, missed: list[int], source: Any, version: int, timeout: float, bucket_bytes: int,
                  carrier: str) -> list[int]:
        """The same update again to the ``missed`` replicas that are alive (their gates still
        closed); a dead one leaves the rotation. The ones that took it."""
        alive: list[int] = []
        for i, ref in [(i, self.replicas[i].stats.remote()) for i in missed]:
            try:
                ref.get(timeout=timeout)
                alive.append(i)
            except WorkerDiedError as exc:
                self._drop(i, f"its process died: {exc.message}")
            except PodiumError as exc:
                self._drop(i, f"it did not answer after a failed update: {exc}")
        if not alive:
            return []
        again = self._broadcast(source, version, timeout, bucket_bytes, [self.replicas[i] for i in alive], carrier)
        return [alive[p] for p, out in enumerate(again.outcomes) if isinstance(out, dict)]

    def _begin(self, targets: list[int], policy: str, timeout: float, began: list[int]) -> list[dict]:
        """``begin_update`` on every target; a replica whose process died leaves the rotation
        (the update goes on without it), any other failure is raised once all answered."""
        refs = [(i, self.replicas[i].begin_update.remote(policy, timeout=timeout)) for i in targets]
        begun: list[dict] = []
        first: BaseException | None = None
        for i, ref in refs:
            try:
                begun.append(ref.get(timeout=timeout + 10))
                began.append(i)
            except WorkerDiedError as exc:
                self._drop(i, f"its process died: {exc.message}")
            except PodiumError as exc:
                first = first or _typed(exc, replica=self.names[i])
        if first is not None:
            raise first
        if not began:
            raise UnavailableError(f"no rollout replica is left to update: {self.dropped}")
        return begun

    def _gather(self, refs: list, timeout: float, ok: list[int] | None = None) -> list:
        # Every ref is waited for (none left running unseen); the first error is raised after.
        values: list = []
        first: BaseException | None = None
        for i, ref in enumerate(refs):
            try:
                values.append(ref.get(timeout=timeout))
                if ok is not None:
                    ok.append(i)
            except PodiumError as exc:
                first = first or _typed(exc)
        if first is not None:
            raise first
        return values

    def _broadcast(self, source: Any, version: int, timeout: float, bucket_bytes: int, replicas: list[Any],
                   carrier: str = "chain") -> UpdateOutcome:
        """One update to ``replicas`` (actor handles), by the driver broadcast_weights uses;
        each one's outcome, in order."""
        extra = {} if carrier == "chain" else {"carrier": carrier}  # a hand-written source may not take it
        reach = Replicas(
            prepare=lambda kind, t: self._gather([r.broadcast_prepare.remote(t, kind) for r in replicas], t + 10),
            receive=lambda kind, routes, step: [r.broadcast_receive.remote(d, step, kind)
                                                for r, d in zip(replicas, routes)])
        sender = Source(send=lambda kind, route, step: source.broadcast_send(route, step=step, bucket_bytes=bucket_bytes,
                                                                             timeout=timeout, **extra),
                        prepare=lambda kind, receivers: source.broadcast_open(receivers, carrier=kind,
                                                                              bucket_bytes=bucket_bytes, timeout=timeout))
        return drive_update(carrier, reach, sender, version, timeout)

    # ------------------------------------------------------------------ life

    def stats(self) -> list[dict]:
        """:meth:`RolloutServer.stats` of each replica in the rotation."""
        return self._gather([self.replicas[i].stats.remote() for i in self._serving()], 60)

    def shutdown(self) -> None:
        """Stop the engines and the actors, and this manager's threads."""
        import podium

        standbys = self.healer.stop()  # first: nothing is replaced while the pool stops
        self._pool.shutdown(wait=False, cancel_futures=True)
        everyone = [*self.replicas, *standbys]
        try:
            for ref in [r.shutdown.remote() for r in everyone]:
                try:
                    ref.get(timeout=60)
                except (WorkerDiedError, DeadlineExceededError):
                    pass  # died earlier, or too busy to stop cleanly (unresponsive): killed below
        finally:
            for r in everyone:
                podium.kill(r)
