"""The workload both backends run: one worker class body written against verl's API.

``define_bench_worker(api)`` builds the class from whichever names ``verl_api(backend)``
imported (verl's ``Worker``/``register``/``Dispatch`` for Ray, Podium's for Podium), so the
two sides run the same code line for line. This module imports neither verl nor Podium at
the top: each child process imports only its own backend.

Also here: the DataProto payload of the throughput measure, and the worker-side clock
readings (process start, constructed, first call) behind the cold-start breakdown.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

# Rows of the throughput batch: divisible by every N the bench runs (1, 2, 4, 8), so
# DP_COMPUTE_PROTO splits it evenly without auto-padding on either side.
PAYLOAD_ROWS = 1024


def verl_api(backend: str) -> SimpleNamespace:
    """The verl-named API of ``backend`` ("ray" or "podium"): Worker, register, Dispatch, DataProto."""
    if backend == "ray":
        from verl.protocol import DataProto
        from verl.single_controller.base import Worker
        from verl.single_controller.base.decorator import Dispatch, register
    elif backend == "podium":
        from podium import DataProto
        from podium.worker import Dispatch, Worker, register
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return SimpleNamespace(Worker=Worker, register=register, Dispatch=Dispatch, DataProto=DataProto)


def proc_stat_fields(pid: int | str) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name (fields[0] is field 3,
    the state), split safely whatever the name holds; OSError where it cannot be read."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()


def process_start_epoch() -> float | None:
    """Wall-clock time (epoch seconds) at which this process started, or None off Linux.

    /proc gives the start in clock ticks since boot (10 ms resolution); CLOCK_BOOTTIME
    turns that into an offset from now, which is finer than /proc/stat's whole-second btime.
    """
    try:
        fields = proc_stat_fields("self")
        start_ticks = int(fields[19])  # field 22 overall; fields[0] is field 3 (state)
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def serving_epoch_from_log() -> float | None:
    """When this process logged that it serves (Podium's worker host: "... serving on ..."), or None.

    The node agent sends a worker's stderr to a per-rank log file, and the host's log
    lines start with ``asctime`` (local time, millisecond precision), so the stamp is read
    back from the file behind fd 2. Ray's workers log nothing of the kind: None there.
    """
    try:
        path = os.readlink("/proc/self/fd/2")
        if not path.startswith("/"):
            return None
        with open(path, errors="replace") as log:
            for line in log:
                if " serving on " in line:
                    stamp, millis = line[:23].split(",")
                    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1e3
    except (OSError, ValueError):
        return None
    return None


def define_bench_worker(api: SimpleNamespace, import_torch: bool = False) -> type:
    """The benchmark worker class, built on ``api.Worker`` with ``api.register``/``api.Dispatch``.

    ``import_torch``: the constructor imports torch first, as a training worker would
    (for the second cold-start measure).

    Methods: ``noop`` (ONE_TO_ALL, blocking), ``noop_nonblocking`` (ONE_TO_ALL,
    blocking=False), ``add_one`` (DP_COMPUTE_PROTO: every tensor +1, returned), and
    ``startup_times`` (ONE_TO_ALL: the clock readings of the cold-start breakdown).
    """
    Worker, register, Dispatch = api.Worker, api.register, api.Dispatch

    class BenchWorker(Worker):
        """A worker whose methods cost as little as possible, so the bench times the RPC layer."""

        def __init__(self):
            if import_torch:
                import torch  # noqa: F401
            super().__init__()
            # Read in __init__ (not at import) so a reused, prestarted process still says
            # when this object came to be.
            self._process_started = process_start_epoch()
            self._constructed = time.time()
            self._first_call = None
            self._env_times = {k: v for k, v in os.environ.items()
                               if k.startswith("PODIUM_") and ("TIME" in k or k.endswith("_AT"))}

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def noop(self):
            """Do nothing; the first call is stamped for the cold-start breakdown."""
            if self._first_call is None:
                self._first_call = time.time()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        def noop_nonblocking(self):
            """Do nothing; registered non-blocking so the group call returns futures."""

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def add_one(self, data):
            """Add 1 in place to every tensor of this rank's shard and send the shard back."""
            for key in list(data.batch.keys()):
                data.batch[key] += 1
            return data

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def startup_times(self):
            """Epoch seconds: process start, serving (from the log, where there is one), object
            constructed, first ``noop``; plus PODIUM_* stamps from the environment."""
            return {"pid": os.getpid(), "process_started": self._process_started,
                    "serving": serving_epoch_from_log(),
                    "constructed": self._constructed, "first_call": self._first_call,
                    "env": self._env_times}

    return BenchWorker


def make_payload(api: SimpleNamespace, mib: int):
    """A DataProto holding one float32 tensor of exactly ``mib`` MiB (PAYLOAD_ROWS rows)."""
    import torch

    nbytes = mib * 1024 * 1024
    cols = nbytes // 4 // PAYLOAD_ROWS
    return api.DataProto.from_dict(tensors={"x": torch.zeros(PAYLOAD_ROWS, cols, dtype=torch.float32)})


def payload_nbytes(data) -> int:
    """Bytes of tensor data in a DataProto's batch."""
    return sum(t.numel() * t.element_size() for t in data.batch.values())
