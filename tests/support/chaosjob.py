"""The job the chaos soak (:mod:`tests.support.chaos`) drives through faults.

A GRPO-shaped loop, as a verl trainer runs it: a 4-rank policy group on two of the nodes
(``ResourcePool([2, 2])``) makes rollouts with a ``blocking=False`` method (a
``DataProtoFuture``), updates on them, the loss is ``put`` and scored by a task, and a
tracker actor records it. Every call is timed against its bound and its outcome sorted:
a value (checked), a typed Podium error (the fault reached it: the job rebuilds what broke,
as a trainer's retry loop would), or anything else (a defect). A :class:`RankBook` keeps
every process that ever held a rank, by pid and start time, so a rank live twice is seen.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import traceback
from typing import Any, Callable

import torch

import podium
from podium import DataProto
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.errors import PodiumError
from podium.worker import Dispatch, Worker, register
from tests.support.proctable import stat_fields

__all__ = ["CALL_BOUND", "BUILD_BOUND", "MARGIN", "LIVENESS", "Job", "RankBook"]

#: The job's call deadline (``call_timeout``) and a group build's placement deadline (s).
CALL_BOUND = 30.0
BUILD_BOUND = 60.0
#: Slack over a call's own deadline before it counts as hung (a loaded 2-core machine).
MARGIN = 30.0
#: ``PODIUM_LIVENESS_SECONDS`` of the soak: a stopped rank fails its calls after this.
LIVENESS = 5.0
ROWS, WIDTH = 64, 256


class Policy(Worker):
    """The policy role: rollouts kept in the workers, and an update on them."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate(self, data):
        data.batch["x"] = data.batch["x"] + 1
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update(self, data):
        return DataProto.from_dict({"loss": data.batch["x"].sum(dim=1, keepdim=True)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


@podium.remote(num_cpus=0.5)
def score(loss):
    """The reward task: the loss tensor arrives as a value (a put ref)."""
    return float(loss.sum())


@podium.remote(num_cpus=0.5)
class Tracker:
    """An actor counting the steps it was told of."""

    def __init__(self) -> None:
        self.seen = 0

    def record(self, value: float) -> int:
        self.seen += 1
        return self.seen

    def pid(self) -> int:
        return os.getpid()


class RankBook:
    """Every process that held a rank: ``(role, rank) -> [(pid, start time)]``."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], list[tuple[int, str]]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def record(self, role: str, rank: int, pid: int) -> None:
        """``pid`` now holds ``role``'s ``rank``."""
        fields = stat_fields(pid)
        if fields is not None:  # gone already: it can be live twice no more
            with self._lock:
                self._held[(role, rank)].append((pid, fields[19]))

    @staticmethod
    def _live(pid: int, started: str) -> bool:
        fields = stat_fields(pid)  # a stopped process (T) is live: SIGCONT brings it back
        return fields is not None and fields[19] == started and fields[0] not in ("Z", "X")

    def copies(self) -> list[tuple[str, int, list[int]]]:
        """Ranks with more than one live process now."""
        with self._lock:
            held = {key: list(pids) for key, pids in self._held.items()}
        out = []
        for (role, rank), pids in held.items():
            live = [pid for pid, started in pids if self._live(pid, started)]
            if len(live) > 1:
                out.append((role, rank, live))
        return out

    def live_pids(self) -> list[int]:
        """Every recorded process still live (none may be left after the job)."""
        with self._lock:
            held = [entry for pids in self._held.values() for entry in pids]
        return [pid for pid, started in held if self._live(pid, started)]


class Job(threading.Thread):
    """The loop; ``counts`` and ``defects`` say how every call ended (see the module)."""

    def __init__(self) -> None:
        super().__init__(name="chaos-job", daemon=True)
        self.book = RankBook()
        self.stop = threading.Event()
        self.steps = 0
        self.rebuilds = 0
        #: Outcomes by kind: "ok", or the typed error's class name.
        self.counts: collections.Counter[str] = collections.Counter()
        #: The first message of each typed error class met (what a user would read).
        self.examples: dict[str, str] = {}
        #: Untyped errors, wrong values, calls over their bound (text each).
        self.defects: list[str] = []
        #: The call in flight: (what, started, bound), for the watchdog.
        self.current: tuple[str, float, float] | None = None
        self._wg: WorkerGroup | None = None
        self._tracker: Any = None
        self._pids: dict[str, list[int]] = {}

    # -- what the fault driver reads ----------------------------------------------------
    def victims(self) -> list[int]:
        """Pids of the job's live rank processes (the policy ranks and the tracker)."""
        return [pid for pids in list(self._pids.values()) for pid in pids]

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self._step()
            except BaseException as exc:  # noqa: BLE001 - a defect, not a crash of the soak
                self.defects.append(f"the job loop raised: {traceback.format_exc()[-2000:]}")
                time.sleep(1.0)
                if isinstance(exc, KeyboardInterrupt):
                    raise

    def _call(self, what: str, fn: Callable[[], Any], bound: float = CALL_BOUND) -> tuple[bool, Any]:
        """Run one call: (True, value), or (False, its typed error); other errors and calls
        past ``bound + MARGIN`` are defects."""
        started = time.monotonic()
        self.current = (what, started, bound)
        try:
            value = fn()
            ok, outcome = True, value
        except PodiumError as exc:
            ok, outcome = False, exc
        except Exception as exc:  # noqa: BLE001 - an untyped error is what the soak hunts
            ok, outcome = False, exc
            self.defects.append(f"{what}: untyped {type(exc).__name__}: {exc}"[:500])
        finally:
            self.current = None
        took = time.monotonic() - started
        if took > bound + MARGIN:
            self.defects.append(f"{what} took {took:.1f} s (bound {bound} s)")
        kind = "ok" if ok else type(outcome).__name__
        self.counts[kind] += 1
        if not ok:
            self.examples.setdefault(kind, f"{what}: {str(outcome).splitlines()[0][:240]}")
        return ok, outcome

    def _wrong(self, what: str, got: Any, want: Any) -> None:
        self.defects.append(f"{what}: wrong value {got!r}, expected {want!r}"[:500])

    def _build(self) -> bool:
        def make() -> WorkerGroup:
            return WorkerGroup(ResourcePool([2, 2], use_gpu=True, max_colocate_count=1),
                               ClassWithInitArgs(Policy), name_prefix="chaos")

        ok, wg = self._call("build group", make, BUILD_BOUND + CALL_BOUND)
        if not ok:
            time.sleep(1.0)  # the scheduler is down or a node is out: try again
            return False
        ok, pids = self._call("group pids", wg.pid)
        if not ok:
            self._teardown(wg)
            return False
        for rank, pid in enumerate(pids):
            self.book.record("policy", rank, pid)
        self._wg, self._pids["policy"] = wg, pids
        self.rebuilds += 1
        return True

    def _teardown(self, wg: WorkerGroup | None) -> None:
        self._wg, self._pids["policy"] = None, []
        if wg is not None:
            self._call("shutdown group", wg.shutdown)

    def _tracker_ready(self) -> bool:
        if self._tracker is not None:
            return True
        ok, handle = self._call("start actor", Tracker.remote, BUILD_BOUND + CALL_BOUND)
        if ok:
            ok, pid = self._call("actor pid", lambda: podium.get(handle.pid.remote(), timeout=CALL_BOUND))
            if ok:
                self.book.record("tracker", 0, pid)
                self._tracker, self._pids["tracker"] = handle, [pid]
                return True
            self._call("kill actor", lambda: podium.kill(handle))
        return False

    def _drop_tracker(self) -> None:
        handle, self._tracker, self._pids["tracker"] = self._tracker, None, []
        if handle is not None:
            self._call("kill actor", lambda: podium.kill(handle))

    def _step(self) -> None:
        if self._wg is None and not self._build():
            return
        wg = self._wg
        assert wg is not None
        n = float(self.steps % 1000)
        batch = DataProto.from_dict({"x": torch.full((ROWS, WIDTH), n)})
        ok, rollouts = self._call("generate", lambda: wg.generate(batch))
        if ok:
            batch.batch["x"].fill_(-1.0)  # the call returned: its argument is a snapshot
            ok, out = self._call("update", lambda: wg.update(rollouts))
        if not ok:
            self._teardown(wg)
            return
        loss = out.batch["loss"]
        want = (n + 1) * WIDTH
        if not torch.equal(loss, torch.full((ROWS, 1), want)):
            self._wrong("update", loss.flatten()[:4].tolist(), want)
        ok, total = self._call("task", lambda: podium.get(score.remote(podium.put(loss)),
                                                          timeout=CALL_BOUND))
        if ok and total != want * ROWS:
            self._wrong("task", total, want * ROWS)
        if self._tracker_ready():
            tracker = self._tracker
            ok, seen = self._call("actor", lambda: podium.get(tracker.record.remote(total),
                                                              timeout=CALL_BOUND))
            if not ok:
                self._drop_tracker()
        self.steps += 1

    def finish(self, deadline: float) -> None:
        """Stop the loop (within ``deadline`` s) and tear down what it holds."""
        self.stop.set()
        self.join(timeout=deadline)
        if self.is_alive():
            self.defects.append(f"the job did not stop within {deadline} s")
            return
        self._teardown(self._wg)
        self._drop_tracker()
