"""A worker's cost per call on cold caches, in one process: ``python -m bench.coldcall``.

    python -m bench.coldcall [--calls 3000] [--evict-mib 48] [--controller-n 32] [--json PATH]

At 128 workers on 2 cores each call lands on caches that the other processes have just
used. What a call costs there is set by how much Python it runs, more than by how fast
that Python runs on warm caches (issue 33). ``bench.scale`` measures it at N=128, where runs
minutes apart differ by up to 40%. This measures the same effect in one process, steadily
enough to compare two versions of the worker's path:

* one worker host (``start_host``, the real thing, serving a ``@register``ed no-op) and the
  wire floor (``bench.floors``: a thread that reads Podium's frames, runs the method and
  answers), each answering no-op calls that the main thread sends over loopback TCP;
* the whole process pinned to one CPU, and before each cold call the main thread writes
  ``--evict-mib`` of memory (every cache line of it once), which evicts the caches and
  the TLB as 127 other processes would;
* per side, the CPU time per call of every thread but the caller, warm and cold, as the
  median of three interleaved rounds;
* then, traced in a second pass on a fresh host and floor, the bytecodes and the Python
  function calls each side runs per call (``sys.settrace`` opcode events): a count that
  does not move from run to run;
* first of all, the same count per rank for the controller's side of a blocking no-op
  ``ONE_TO_ALL`` (``--controller-n`` ranks of an embedded cluster, its calling thread and
  its event loop) beside the event-loop floor's sender (``bench.floors``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import uvloop

from bench.floors import _serve_wire, fanout
from bench.measure import processes_cpu_seconds
from podium.transport import callsocket
from podium.transport.frames import FRAME_LENGTH, call_frame_tail, frame_with_call_id, trace_suffix
from podium.v1 import worker_pb2
from podium.worker import Dispatch, register
from podium.worker.caller.client import WorkerClient, prepare
from podium.worker.host.process import start_host

_ROUNDS = 3


class _Noop:
    """The hosted object: one registered no-op, as a user's worker declares it."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        """The method each call runs."""


class _Side:
    """One answering side (a worker host or the floor) and the caller's socket to it."""

    def __init__(self, name: str, sock: socket.socket, stop: Callable[[], None]) -> None:
        self.name = name
        self.sock = sock
        self.stop = stop
        self._tail = _call_tail()
        self._next = 1

    def call(self) -> None:
        """One no-op call and its whole reply."""
        call_id, self._next = self._next, self._next + 1
        frame = frame_with_call_id(call_id, self._tail) + trace_suffix(call_id)
        self.sock.sendall(FRAME_LENGTH.pack(len(frame)) + frame)
        reply = b""
        while len(reply) < 4 or len(reply) < 4 + FRAME_LENGTH.unpack_from(reply)[0]:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError(f"{self.name} closed the connection")
            reply += data


def _call_tail() -> bytes:
    data = b"".join(prepare(((), {})).segments())
    return call_frame_tail(worker_pb2.CALL, "noop", data, hold=False, timeout=30.0, reply_in_shm=False)


def _loopback_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=30)
        served, _ = server.accept()
    for sock in (client, served):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, served


def start_floor() -> _Side:
    """The wire floor answering on a thread of its own."""
    client, served = _loopback_pair()
    threading.Thread(target=_serve_wire, args=(served,), name="floor", daemon=True).start()
    return _Side("floor", client, client.close)


def start_worker() -> _Side:
    """A worker host on its own uvloop thread, its object built, and a raw call socket to it."""
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, name="worker-loop", daemon=True).start()
    token = "coldcall-" + os.urandom(12).hex()

    async def setup() -> Any:
        host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"})
        client = WorkerClient(host.address, token)
        await client.start(timeout=30)
        await client.construct((_Noop, (), {}), timeout=30)
        await client.close()
        return host

    host = asyncio.run_coroutine_threadsafe(setup(), loop).result(60)
    sock = socket.create_connection(("127.0.0.1", host.runtime.call_port), timeout=30)
    sock.sendall(callsocket.hello(token))
    if sock.recv(1) != b"\x00":
        raise ConnectionError("the worker host refused the call socket's handshake")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stop() -> None:
        sock.close()
        asyncio.run_coroutine_threadsafe(host.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)

    return _Side("worker", sock, stop)


def _others_cpu_ns() -> int:
    """CPU time of every thread of this process but the calling one."""
    return int(processes_cpu_seconds([os.getpid()]) * 1e9) - time.thread_time_ns()


def cpu_per_call(side: _Side, calls: int, evict: Any) -> float:
    """Microseconds of the answering side's CPU per call; ``evict`` (a uint8 tensor, or None
    for warm caches) is written through before each call."""
    before = _others_cpu_ns()
    for _ in range(calls):
        if evict is not None:
            evict[::64] += 1  # every cache line once
        side.call()
    return (_others_cpu_ns() - before) / 1e3 / calls


class _Counter:
    """A trace function counting bytecodes and Python function calls while :attr:`on`
    (on every thread but ``skip``, when given)."""

    def __init__(self, skip: int | None = None) -> None:
        self.on = False
        self.counts: collections.Counter = collections.Counter()
        self._skip = skip

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        """The ``sys.settrace`` function."""
        if self.on and threading.get_ident() != self._skip:
            frame.f_trace_opcodes = True
            self.counts[event] += 1
        return self.trace

    def per(self, units: int, minus: _Counter | None = None) -> dict[str, float]:
        """Bytecodes and calls per unit (less what ``minus`` counted)."""
        less = minus.counts if minus is not None else collections.Counter()
        return {"bytecodes": (self.counts["opcode"] - less["opcode"]) / units,
                "py_calls": (self.counts["call"] - less["call"]) / units}


def count_per_call(start: Callable[[], _Side], calls: int) -> dict[str, float]:
    """Bytecodes and Python function calls per call on the threads ``start`` starts."""
    counter = _Counter(skip=threading.get_ident())
    threading.settrace(counter.trace)  # the threads started from here on
    try:
        side = start()
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    try:
        for _ in range(100):
            side.call()
        counter.on = True
        for _ in range(calls):
            side.call()
        counter.on = False
    finally:
        side.stop()
    counts = counter.per(calls)
    return {"bytecodes_per_call": counts["bytecodes"], "py_calls_per_call": counts["py_calls"]}


def controller_counts(n: int, calls: int) -> list[dict[str, Any]]:
    """Bytecodes and Python calls per rank of a blocking no-op ``ONE_TO_ALL`` to ``n`` ranks:
    from Podium's controller (the calling thread and its event loop), on an embedded cluster;
    and from the event-loop floor's sender (``bench.floors.fanout``, ``sender="uvloop"``), as
    the difference between ``calls`` and ``2 * calls`` calls, so its set-up is not counted."""
    from bench import workloads
    from bench.podium_side import PodiumAdapter
    from podium.controller.session.runtime import get_runtime

    floor = []
    for count in (calls, 2 * calls):
        floor.append(_Counter())
        # (Before the cluster's gRPC threads start, which would make forking noisy. The forked
        # ranks inherit the trace and count in their own memory.)
        sys.settrace(floor[-1].trace)
        floor[-1].on = True
        try:
            fanout(n, count, kind="wire", sender="uvloop")
        finally:
            sys.settrace(None)
    counter = _Counter()
    adapter = PodiumAdapter()
    adapter.start(n)
    try:
        group = adapter.make_group(workloads.define_bench_worker(workloads.verl_api("podium")), n)
        for _ in range(50):
            group.noop()
        loop = get_runtime(auto_init=False).loop
        asyncio.run_coroutine_threadsafe(_settrace(counter.trace), loop).result(30)
        sys.settrace(counter.trace)
        counter.on = True
        for _ in range(calls):
            group.noop()
        counter.on = False
        sys.settrace(None)
        asyncio.run_coroutine_threadsafe(_settrace(None), loop).result(30)
        adapter.destroy_group(group)
    finally:
        adapter.stop()
    podium, sender = counter.per(calls * n), floor[1].per(calls * n, minus=floor[0])
    return [{"side": "controller", "n": n, "bytecodes_per_rank": podium["bytecodes"],
             "py_calls_per_rank": podium["py_calls"]},
            {"side": "event-loop floor sender", "n": n, "bytecodes_per_rank": sender["bytecodes"],
             "py_calls_per_rank": sender["py_calls"]}]


async def _settrace(function: Any) -> None:
    sys.settrace(function)  # (on the loop's thread, between two of its steps)


def measure(calls: int, evict_mib: int) -> list[dict[str, Any]]:
    """The rows: per side, warm and cold CPU per call, then the traced counts."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before any thread starts
    torch.set_num_threads(1)  # the eviction runs on the caller thread, not on a pool counted as the side's
    evict = torch.zeros(evict_mib << 20, dtype=torch.uint8)
    starters = {"worker": start_worker, "floor": start_floor}
    sides = [start() for start in starters.values()]
    cells: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    try:
        for side in sides:
            for _ in range(300):
                side.call()
        for _ in range(_ROUNDS):
            for caches, tensor in (("warm", None), ("cold", evict)):
                for side in sides:
                    cells[side.name, caches].append(cpu_per_call(side, calls // _ROUNDS, tensor))
    finally:
        for side in sides:
            side.stop()
    rows = []
    for side in sides:
        row: dict[str, Any] = {"side": side.name}
        for caches in ("warm", "cold"):
            row[f"{caches}_us_per_call"] = statistics.median(cells[side.name, caches])
        row.update(count_per_call(starters[side.name], 200))
        rows.append(row)
    worker, floor = rows
    rows.append({"side": "worker/floor", **{key: worker[key] / floor[key] for key in worker if key != "side"}})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per side (the controller's and its floor's counts first), and one
    of the worker's ratios to its floor."""
    parser = argparse.ArgumentParser(prog="python -m bench.coldcall", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls per side and cache state")
    parser.add_argument("--evict-mib", type=int, default=48, help="memory written before each cold call")
    parser.add_argument("--controller-n", type=int, default=32,
                        help="ranks of the controller's traced fan-out (0: skip it)")
    parser.add_argument("--json", metavar="PATH", help="also append the lines here")
    args = parser.parse_args(argv)
    if not 3 <= args.calls <= 1_000_000 or not 1 <= args.evict_mib <= 4096 or not 0 <= args.controller_n <= 256:
        parser.error("--calls must be 3..1000000, --evict-mib 1..4096 and --controller-n 0..256")
    # The controller first: measure() pins this process to one CPU, and the cluster's
    # processes would inherit that.
    rows = controller_counts(args.controller_n, 100) if args.controller_n else []
    rows += measure(args.calls, args.evict_mib)
    lines = [json.dumps({k: round(v, 2) if type(v) is float else v for k, v in row.items()}) for row in rows]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
