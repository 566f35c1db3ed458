"""Replicas that come back: :class:`ReplicaHealer`, the part of a
:class:`~podium.rollout.servermanager.RolloutServerManager` that replaces rollout replicas.

A thread probes the replicas in the rotation (their ``stats``, within ``probe_timeout``)
every ``interval`` seconds. A replica whose process died, or that did not answer, leaves
the rotation (requests to it fail with a typed error, as before) and is replaced:

1. its process is killed, in the background: out of the rotation since it was dropped, it
   gets no request or update again, so it never serves beside its replacement;
2. a warm standby takes its place (one built at launch, engine already started), or a new
   replica is started (its load time: the process, the engine, the warm-up);
3. the newcomer loads the current weights through the weight broadcast (the source of the
   last update, at its version) before it takes any request;
4. it rejoins the balancer under the slot's name.

A replica that is alive but missed an update is not replaced: the manager sends it the same
update again right away (:meth:`RolloutServerManager.update_weights`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

from podium.errors import InvalidArgumentError, PodiumError, WorkerDiedError

__all__ = ["ReplicaHealer", "MAX_STANDBYS"]

#: Most warm standbys one manager keeps.
MAX_STANDBYS = 64


class ReplicaHealer:
    """Probes the manager's replicas and replaces the ones that died or stopped answering.

    ``spawn(slot)`` starts a new replica for slot ``slot`` (None: only standbys replace);
    ``standbys`` are started replicas outside the rotation, used first."""

    def __init__(self, manager: Any, spawn: Callable[[int], Any] | None, standbys: list[Any],
                 interval: float = 1.0, probe_timeout: float = 10.0) -> None:
        for value, what in ((interval, "health_interval"), (probe_timeout, "probe_timeout")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise InvalidArgumentError(f"{what} must be seconds in (0, 3600], got {value!r}")
        if len(standbys) > MAX_STANDBYS:
            raise InvalidArgumentError(f"at most {MAX_STANDBYS} standbys, got {len(standbys)}")
        self.manager = manager
        self.spawn = spawn
        self.standbys = list(standbys)
        self.interval, self.probe_timeout = float(interval), float(probe_timeout)
        #: One entry per replacement: ``{"replica", "why", "from", "load_s", "catch_up_s",
        #: "back_s", "version"}`` (``back_s``: from leaving the rotation to rejoining it).
        self.replacements: list[dict] = []
        #: Why the last replacement of a slot failed, by slot name (it is tried again next tick).
        self.failures: dict[str, str] = {}
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="podium-rollout-heal")
        self._thread = threading.Thread(target=self._run, name="podium-rollout-healer", daemon=True)

    @property
    def active(self) -> bool:
        """Whether dead replicas can be replaced (a spawn function or a standby is left)."""
        return self.spawn is not None or bool(self.standbys)

    def start(self) -> None:
        """Start probing."""
        self._thread.start()

    def stop(self) -> list[Any]:
        """Stop probing and replacing; the standbys left (for the caller to stop)."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            self._thread.join(self.probe_timeout + 5)
        with self._lock:
            left, self.standbys = self.standbys, []
        return left

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the healer outlives one bad tick
                self.failures["probe"] = f"{type(exc).__name__}: {exc}"

    def tick(self) -> None:
        """Probe the rotation once, then start replacing every slot out of it."""
        manager = self.manager
        if not manager.updating:  # an update finds its own dead replicas
            self.probe()
        for i in manager.dropped_slots():
            with self._lock:
                if i in self._busy or not self.active or self._stop.is_set():
                    continue
                self._busy.add(i)
            self._pool.submit(self._replace_logged, i)

    def probe(self) -> None:
        """``stats`` of every replica in the rotation; one that died or did not answer
        within ``probe_timeout`` leaves it."""
        manager = self.manager
        handles = [(i, manager.replicas[i]) for i in manager.serving_slots()]
        refs = [(i, handle, handle.stats.remote()) for i, handle in handles]
        deadline = time.monotonic() + self.probe_timeout
        for i, handle, ref in refs:  # a slot refilled meanwhile keeps its newcomer
            try:
                ref.get(timeout=max(deadline - time.monotonic(), 0.01))
            except WorkerDiedError as exc:
                manager.drop(i, f"its process died: {exc.message}", handle)
            except PodiumError as exc:
                manager.drop(i, f"it did not answer a health probe within {self.probe_timeout:g} s: {exc}", handle)

    def _replace_logged(self, i: int) -> None:
        try:
            self.replace(i)
        except Exception as exc:  # noqa: BLE001 - recorded; the slot is tried again next tick
            self.failures[self.manager.names[i]] = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._busy.discard(i)

    def replace(self, i: int) -> dict:
        """Replace slot ``i`` (out of the rotation) and bring the newcomer back; its entry
        of :attr:`replacements`."""
        import podium

        manager = self.manager
        name = manager.names[i]
        why, left_at = manager.dropped_since(name)
        # Fenced: out of the rotation since it was dropped, no request or update reaches it
        # again; its process is killed while the replacement comes (a stopped one takes seconds).
        self._pool.submit(_kill_quietly, manager.replicas[i])
        start = time.monotonic()
        with self._lock:
            handle = self.standbys.pop(0) if self.standbys else None
        origin = "standby" if handle is not None else "new"
        if handle is None:
            if self.spawn is None:
                raise InvalidArgumentError(f"no standby left to replace {name}, and no way to start one")
            handle = self.spawn(i)
        loaded = time.monotonic()
        try:
            version, catch_up_s = manager.install(i, handle)
        except BaseException:
            podium.kill(handle)  # a newcomer that could not catch up never serves
            raise
        entry = {"replica": name, "why": why, "from": origin, "load_s": loaded - start, "catch_up_s": catch_up_s,
                 "back_s": time.monotonic() - left_at, "version": version}
        self.replacements.append(entry)
        self.failures.pop(name, None)
        return entry


def _kill_quietly(handle: Any) -> None:
    import podium

    try:
        podium.kill(handle)
    except PodiumError:  # already gone
        pass
