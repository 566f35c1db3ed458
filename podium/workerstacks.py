"""The Python stacks of live workers (``podium stack``, ``podium.stacks()``, ``GET /v1/stacks``).

Every selected worker is asked in parallel (``Worker.Stacks``, answered by its event loop,
so a rank busy in a long method still answers), each with a short deadline; at the same
time each node agent is asked once for the kernel's view of its workers
(``NodeAgent.ProcessStates``: the ``/proc/PID/stat`` state and wchan). A worker that does
not answer (stopped with SIGSTOP, stuck in native code holding the GIL, an ``async``
method blocking its loop) is named with that state and why it has no stacks.

The scheduler's :class:`ClusterState` says which workers exist, where they serve and where
their agents listen; the stacks themselves come straight from the workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grpc

from podium.auth import TlsConfig
from podium.limits import check_seconds
from podium.rpc import make_channel
from podium.v1 import common_pb2, node_pb2, node_pb2_grpc, scheduler_pb2, worker_pb2, worker_pb2_grpc

__all__ = ["ThreadStack", "WorkerStacks", "DEFAULT_TIMEOUT_SECONDS", "MAX_TIMEOUT_SECONDS",
           "StackReport", "select_workers", "collect", "collect_from", "render", "first_lines"]

#: How long each worker (and each agent) may take to answer by default.
DEFAULT_TIMEOUT_SECONDS = 2.0
#: The longest per-worker deadline a caller may ask for.
MAX_TIMEOUT_SECONDS = 60.0


@dataclasses.dataclass
class ThreadStack:
    """One thread of a worker process and its Python frames (outermost first)."""

    name: str
    ident: int
    native_id: int
    daemon: bool
    stack: str
    frames_omitted: int = 0

    def __str__(self) -> str:
        head = f"--- thread {self.name or '?'} (tid {self.native_id or '?'}{', daemon' if self.daemon else ''})"
        more = f"  ... {self.frames_omitted} outer frames left out\n" if self.frames_omitted else ""
        return f"{head}\n{more}{self.stack.rstrip()}"


@dataclasses.dataclass
class WorkerStacks:
    """What one worker answered, or the kernel's view of it when it could not."""

    group: str
    rank: int
    worker_id: str
    node: str
    pid: int
    #: The /proc state letter ("S", "R", "T", ...; "" when unknown) and its name.
    state: str = ""
    state_name: str = ""
    #: The kernel function it sleeps in, where readable.
    wchan: str = ""
    threads: list[ThreadStack] = dataclasses.field(default_factory=list)
    #: Why there are no stacks ("" when the worker answered).
    error: str = ""

    @property
    def answered(self) -> bool:
        """Whether the worker itself answered with its stacks."""
        return not self.error

    def header(self) -> str:
        """One line: who, where, and the kernel's state."""
        state = f"{self.state} ({self.state_name})" if self.state else (self.state_name or "unknown")
        wchan = f", wchan {self.wchan}" if self.wchan else ""
        return (f"=== group {self.group or '-'} rank {self.rank} worker {self.worker_id} "
                f"node {self.node} pid {self.pid}: {state}{wchan}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``GET /v1/stacks`` sends), with ``answered``."""
        out = dataclasses.asdict(self)
        out["answered"] = self.answered
        return out

    def __str__(self) -> str:
        if self.error:
            return f"{self.header()}\nno stacks: {self.error}"
        return "\n".join([self.header(), *map(str, self.threads)])


def render(results: list[WorkerStacks]) -> str:
    """The answers one after the other, a blank line between workers."""
    return "\n\n".join(map(str, results)) if results else "no live worker matched"


class StackReport(list):
    """The :class:`WorkerStacks` of one collection, in (group, rank) order; ``str()`` prints
    them all (:func:`render`)."""

    def __str__(self) -> str:
        return render(self)

    def to_dict(self) -> dict[str, Any]:
        """``{"workers": [...]}``, what ``GET /v1/stacks`` sends."""
        return {"workers": [r.to_dict() for r in self]}


def select_workers(state: scheduler_pb2.ClusterState, *, group: str | None = None, rank: int | None = None,
                   worker_id: str | None = None) -> list[common_pb2.WorkerInfo]:
    """The running workers of ``state`` that match every filter given, by (group, rank)."""
    chosen = [w for w in state.workers if w.state == common_pb2.WORKER_RUNNING and w.port
              and (group is None or w.spec.group == group)
              and (rank is None or w.spec.rank == rank)
              and (worker_id is None or worker_id in (w.id, w.spec.name))]
    return sorted(chosen, key=lambda w: (w.spec.group, w.spec.rank, w.id))


async def collect(state: scheduler_pb2.ClusterState, token: str, tls: TlsConfig | None = None, *,
                  group: str | None = None, rank: int | None = None, worker_id: str | None = None,
                  timeout: float = DEFAULT_TIMEOUT_SECONDS, max_frames: int = 0) -> StackReport:
    """Ask every selected worker (:func:`select_workers`) for its stacks and every agent of
    theirs for their /proc state, all in parallel, each within ``timeout`` seconds."""
    workers = select_workers(state, group=group, rank=rank, worker_id=worker_id)
    return await collect_from(state, workers, token, tls, timeout=timeout, max_frames=max_frames)


async def collect_from(state: scheduler_pb2.ClusterState, workers: list[common_pb2.WorkerInfo], token: str,
                       tls: TlsConfig | None = None, *, timeout: float = DEFAULT_TIMEOUT_SECONDS,
                       max_frames: int = 0) -> StackReport:
    """Like :func:`collect`, for these workers of ``state``: one :class:`WorkerStacks` each."""
    timeout = check_seconds(timeout, "timeout", MAX_TIMEOUT_SECONDS) or DEFAULT_TIMEOUT_SECONDS
    agents = {n.info.node_id: f"{n.info.address}:{n.info.agent_port}" for n in state.nodes}
    by_node: dict[str, list[str]] = {}
    for w in workers:
        by_node.setdefault(w.node_id, []).append(w.id)
    asks = [_ask_worker(w, token, tls, timeout, max_frames) for w in workers]
    probes = [_ask_agent(agents.get(node, ""), ids, token, tls, timeout) for node, ids in by_node.items()]
    # Both kinds at once: a silent worker's deadline and its agent's answer overlap.
    answers, found = await asyncio.gather(asyncio.gather(*asks), asyncio.gather(*probes))
    kernel: dict[str, node_pb2.ProcessState | str] = {}
    for per_node in found:
        kernel.update(per_node)
    return StackReport(_result(w, answer, kernel.get(w.id, "")) for w, answer in zip(workers, answers))


async def _ask_worker(info: common_pb2.WorkerInfo, token: str, tls: TlsConfig | None, timeout: float,
                      max_frames: int) -> worker_pb2.StacksResponse | str:
    channel = make_channel(f"{info.node_address}:{info.port}", token, tls)
    try:
        return await worker_pb2_grpc.WorkerStub(channel).Stacks(
            worker_pb2.StacksRequest(max_frames=max_frames), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"it did not answer within {timeout:g} s"
        return f"{exc.code().name}: {exc.details()}"
    finally:
        await channel.close()


async def _ask_agent(address: str, worker_ids: list[str], token: str, tls: TlsConfig | None,
                     timeout: float) -> dict[str, node_pb2.ProcessState | str]:
    if not address:
        return {w: "its node is not registered" for w in worker_ids}
    channel = make_channel(address, token, tls)
    try:
        reply = await node_pb2_grpc.NodeAgentStub(channel).ProcessStates(
            node_pb2.ProcessStatesRequest(worker_ids=worker_ids), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return {w: f"node agent {address}: {exc.code().name}: {exc.details()}" for w in worker_ids}
    finally:
        await channel.close()
    return {s.worker_id: s for s in reply.states}


def _why_silent(letter: str) -> str:
    """What a kernel state says about a worker that did not answer."""
    if letter in ("T", "t"):
        return "the process is stopped (SIGSTOP or a debugger); it answers after SIGCONT"
    if letter == "D":
        return "the process waits in the kernel (uninterruptible I/O)"
    if letter == "Z" or letter == "":
        return "the process has ended"
    return ("the process runs but its event loop does not answer: native code holding the GIL, "
            "or an async method blocking the loop")


def _result(info: common_pb2.WorkerInfo, answer: worker_pb2.StacksResponse | str,
            kernel: node_pb2.ProcessState | str) -> WorkerStacks:
    out = WorkerStacks(group=info.spec.group, rank=info.spec.rank, worker_id=info.id, node=info.node_id,
                       pid=info.pid)
    if isinstance(kernel, node_pb2.ProcessState):
        out.state, out.state_name, out.wchan = kernel.state, kernel.state_name, kernel.wchan
        out.pid = kernel.pid or out.pid
    elif kernel:
        out.state_name = f"unknown ({kernel})"
    if isinstance(answer, str):
        why = _why_silent(out.state) if isinstance(kernel, node_pb2.ProcessState) else ""
        out.error = f"{answer}; {why}" if why else answer
        return out
    out.pid = answer.pid or out.pid
    out.threads = [ThreadStack(name=t.name, ident=t.ident, native_id=t.native_id, daemon=t.daemon,
                               stack=t.stack, frames_omitted=t.frames_omitted) for t in answer.threads]
    return out


def first_lines(result: WorkerStacks, lines: int = 15) -> str:
    """The first ``lines`` lines of ``str(result)`` (for error messages)."""
    text = str(result).splitlines()
    more = f"\n  ... {len(text) - lines} more lines" if len(text) > lines else ""
    return "\n".join(text[:lines]) + more
