"""The worker process runtime: hosts one user object and serves it over gRPC.

The node agent starts this module as ``python -m podium.worker.host --ready-fd N``
with the worker environment (RANK, WORLD_SIZE, PODIUM_WORKER_ID,
PODIUM_NODE_ADDRESS, PODIUM_TOKEN, PODIUM_TLS_CERT/KEY/CA, ...). The process binds
``PODIUM_NODE_ADDRESS:0``, writes one JSON line ``{"port": <int>}`` to the ready
fd, closes it and serves the ``podium.v1.Worker`` service until SIGTERM or a
Shutdown RPC.

How calls run (see ``proto/podium/v1/worker.proto``):

* CONSTRUCT builds the object on the *execution thread*, one dedicated thread
  that also runs every synchronous method, in arrival order: CUDA and NCCL
  state belong to the thread that made them, and collectives must be issued in
  the same order on every rank.
* ``async def`` methods run on the event loop.
* Top-level ObjectRef / DataProtoFuture arguments are fetched from their owners
  (worker to worker) before the method runs, unless its registration says
  ``materialize_futures=False``.
* Results stream back in chunks, through a shared-memory segment when the
  caller is on this host and asked for it, or stay here (``hold_result``) and
  are answered with an ObjectRefInfo; peers Fetch them later.

Tests run a host in-process with :func:`start_host`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import difflib
import inspect
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

import cloudpickle
import grpc

from podium import codec, errors, framing, refs, rpc, shm, shmpool
from podium.auth import TlsConfig, resolve_token
from podium.v1 import worker_pb2, worker_pb2_grpc
from podium.worker.heldstore import HeldStore, default_budget

__all__ = ["RAY_CALL", "ExecutionThread", "HostConfig", "WorkerServicer", "HostResolver", "RunningHost", "start_host",
           "current_host", "main", "DEFAULT_MAX_PAYLOAD_BYTES", "DEFAULT_SHM_THRESHOLD_BYTES",
           "DEFAULT_INLINE_RESULT_BYTES"]

log = logging.getLogger("podium.worker.host")

#: Largest call payload a worker accepts unless PODIUM_MAX_PAYLOAD_BYTES says otherwise.
DEFAULT_MAX_PAYLOAD_BYTES = 16 << 30
#: Results at least this large go through shared memory when the caller asks for it
#: (PODIUM_SHM_THRESHOLD_BYTES); smaller ones are cheaper inline.
DEFAULT_SHM_THRESHOLD_BYTES = 1 << 20
#: Held results up to this size also travel inline with their ref (Ray inlines objects
#: below 100 KiB the same way); PODIUM_INLINE_RESULT_BYTES, 0 turns it off.
DEFAULT_INLINE_RESULT_BYTES = 64 << 10

_CALL, _CONSTRUCT, _CANCEL = worker_pb2.CALL, worker_pb2.CONSTRUCT, worker_pb2.CANCEL

#: Method name of the raw-call escape hatch: ``call(RAY_CALL, (fn, *args))`` runs
#: ``fn(hosted_object, *args)`` on the execution thread (Ray's ``actor.__ray_call__``).
RAY_CALL = "__ray_call__"


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "")
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise errors.InvalidArgumentError(f"{name} must be an integer, got {text!r}") from None


@dataclasses.dataclass
class HostConfig:
    """What a worker host reads from its environment."""

    rank: int = 0
    world_size: int = 1
    worker_id: str = ""
    node_address: str = "127.0.0.1"
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    hold_budget_bytes: int = 0
    shm_threshold_bytes: int = DEFAULT_SHM_THRESHOLD_BYTES
    inline_result_bytes: int = DEFAULT_INLINE_RESULT_BYTES

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, address: str | None = None) -> "HostConfig":
        """Read RANK, WORLD_SIZE, PODIUM_WORKER_ID, PODIUM_NODE_ADDRESS and the byte limits."""
        env = os.environ if env is None else env
        return cls(rank=_int_env(env, "RANK", 0), world_size=_int_env(env, "WORLD_SIZE", 1),
                   worker_id=env.get("PODIUM_WORKER_ID", ""),
                   node_address=address or env.get("PODIUM_NODE_ADDRESS") or "127.0.0.1",
                   max_payload_bytes=_int_env(env, "PODIUM_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES),
                   hold_budget_bytes=default_budget(dict(env)),
                   shm_threshold_bytes=_int_env(env, "PODIUM_SHM_THRESHOLD_BYTES",
                                                DEFAULT_SHM_THRESHOLD_BYTES),
                   inline_result_bytes=_int_env(env, "PODIUM_INLINE_RESULT_BYTES",
                                                DEFAULT_INLINE_RESULT_BYTES))


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class _Outcome:
    """A packaged result: a held ref, a shared-memory segment, or bytes to stream."""

    ref: worker_pb2.ObjectRefInfo | None = None
    shm_name: str = ""
    #: shm_name is a segment of the stream's pool (podium.shmpool), not a one-shot one.
    shm_pooled: bool = False
    segments: list | None = None
    nbytes: int = 0


class _Frozen:
    """A held result's wire form, copied once into one buffer.

    The copy makes a held result a snapshot, as Ray's object store does: user
    code that mutates a returned tensor afterwards cannot change what peers
    fetch. Quacks like :class:`podium.codec.Encoded` (``nbytes``, ``to_segments``).
    """

    __slots__ = ("buffer",)

    def __init__(self, segments: list, nbytes: int) -> None:
        self.buffer = bytearray(nbytes)
        view = memoryview(self.buffer)
        pos = 0
        for segment in segments:
            size = segment.nbytes
            view[pos:pos + size] = segment.cast("B") if segment.ndim != 1 or segment.itemsize != 1 else segment
            pos += size
        view.release()

    @property
    def nbytes(self) -> int:
        """Size of the wire form."""
        return len(self.buffer)

    def to_segments(self) -> list[memoryview]:
        """The wire form as one segment."""
        return [memoryview(self.buffer)]


#: The wire form of None, made once (its segments are immutable bytes).
_ENCODED_NONE = codec.encode(None)
#: Results that cannot change after they are returned: a held one needs no decoded copy.
_IMMUTABLE_RESULTS = frozenset({type(None), bool, int, float, complex, str, bytes})


def _remote_error(exc: BaseException, rank: int, node: str, skip_frames: int = 1) -> errors.RemoteError:
    # Drop the host's own frames so the traceback starts in user code.
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return errors.RemoteError(str(exc), traceback=text, remote_type=name, rank=rank, node=node)


def _call_error(fn: Any, args: Any, kwargs: Any, exc: BaseException, rank: int, node: str
                ) -> errors.PodiumError:
    """What a user method that raised becomes: RemoteError, unless the call itself did not
    match the method's signature (wrong argument count or name), which is the caller's
    ArgumentMismatchError naming the signature. Only runs once a call has failed."""
    if isinstance(exc, TypeError):
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins without a signature
            signature = None
        if signature is not None:
            try:
                signature.bind(*args, **kwargs)
            except TypeError as mismatch:
                name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "method")
                return errors.ArgumentMismatchError(f"{name}{signature}: {mismatch}", rank=rank, node=node)
    return _remote_error(exc, rank, node)


def _close_names(name: str, obj: Any) -> list[str]:
    candidates = [n for n in dir(obj) if not n.startswith("__")]
    return difflib.get_close_matches(name, candidates, n=5, cutoff=0.5)


# --------------------------------------------------------------------------- execution thread


class _Job:
    """One piece of work for the execution thread; its outcome goes to ``future`` (on the
    loop) or, without one, to ``on_done(context, ok, result)`` called on the loop."""

    __slots__ = ("fn", "args", "future", "state", "on_done", "context")

    def __init__(self, fn: Any, args: tuple, future: asyncio.Future | None) -> None:
        self.fn = fn
        self.args = args
        self.future = future
        self.state = 0  # 0 queued, 1 started, 2 cancelled
        self.on_done: Any = None
        self.context: Any = None


class ExecutionThread:
    """The one thread that builds the hosted object and runs its sync methods, in order.

    Leaner than a ThreadPoolExecutor plus ``asyncio.wrap_future`` (a C queue in,
    one ``call_soon_threadsafe`` out), which matters on a no-op call's hot path.
    Daemon, so a method stuck in native code never blocks process exit.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: list = []  # (future, ok, result) waiting for the loop
        self._wake_scheduled = False
        self._thread = threading.Thread(target=self._run, name="podium-exec", daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        """Thread id of the execution thread."""
        return self._thread.ident

    def submit(self, fn: Any, *args: Any) -> _Job:
        """Queue ``fn(*args)``; await ``job.future`` for its result."""
        job = _Job(fn, args, self._loop.create_future())
        self._queue.put(job)
        return job

    def submit_reporting(self, fn: Any, args: tuple, on_done: Any, context: Any) -> _Job:
        """Queue ``fn(*args)``; ``on_done(context, ok, result)`` runs on the loop when it
        finished (ok False: ``result`` is the exception). No future per job."""
        job = _Job(fn, args, None)
        job.on_done = on_done
        job.context = context
        self._queue.put(job)
        return job

    def cancel(self, job: _Job) -> bool:
        """Drop ``job`` if it has not started; True if dropped. Call on the loop."""
        with self._lock:
            if job.state != 0:
                return False
            job.state = 2
        exc = errors.CancelledError("cancelled before it started")
        if job.future is None:
            job.on_done(job.context, False, exc)
        elif not job.future.done():
            job.future.set_exception(exc)
        return True

    def stop(self) -> None:
        """Drop queued jobs and let the thread end after the running one."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if job.state != 0:
                    continue
                job.state = 1
            try:
                result, ok = job.fn(*job.args), True
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting call
                result, ok = exc, False
            # Outcomes of a burst of calls reach the loop with one wake-up, not one each.
            with self._lock:
                self._done.append((job, ok, result))
                wake = not self._wake_scheduled
                self._wake_scheduled = True
            if wake:
                try:
                    self._loop.call_soon_threadsafe(self._settle_done)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    return
            del job, result

    def _settle_done(self) -> None:
        with self._lock:
            done, self._done = self._done, []
            self._wake_scheduled = False
        for job, ok, result in done:
            if job.future is not None:
                _settle(job.future, ok, result)
                continue
            try:
                job.on_done(job.context, ok, result)
            except Exception:  # noqa: BLE001 - one reply's failure must not stop the others
                log.exception("reporting the outcome of %r failed", job.fn)


def _settle(future: asyncio.Future, ok: bool, result: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(result)
    else:
        future.set_exception(result)


# --------------------------------------------------------------------------- servicer


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """The ``podium.v1.Worker`` service around one hosted object."""

    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self.held = HeldStore(config.hold_budget_bytes)
        #: "host:port" peers use to reach this worker (set once bound).
        self.address = ""
        #: Port of the raw call socket (podium.rawcall) on the same address; 0: none.
        self.call_port = 0
        #: Its open connections (closed when the host stops).
        self.raw_connections: set = set()
        #: Counters a test (or a user method, through current_host()) can read.
        self.stats = {"calls": 0, "fetches_served": 0, "bytes_served": 0,
                      "fetches_made": 0, "bytes_fetched": 0, "shm_in": 0, "shm_out": 0,
                      # The call path's counters (node agent /metrics): calls and constructs
                      # running now, finished with an error, seconds spent, payload bytes.
                      "calls_in_flight": 0, "call_errors": 0, "call_seconds": 0.0,
                      "bytes_in": 0, "bytes_out": 0}
        self.stopping = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._exec = ExecutionThread(self._loop)
        self._obj: Any = None
        self._class_name = ""
        self._construct_state = "none"  # none | pending | done | failed
        self._construct_done: asyncio.Future = self._loop.create_future()
        self._construct_error = ""
        # Each CALL/CONSTRUCT takes a gate future at arrival and completes it once
        # it has been handed to the execution thread (or resolved otherwise), after
        # its predecessor's: sync calls thus reach the thread in arrival order even
        # when an earlier one waits for its arguments to be fetched.
        self._gate: asyncio.Future = self._loop.create_future()
        self._gate.set_result(None)
        self._method_info: dict[str, tuple[bool, bool]] = {}
        self._hostname = socket.gethostname()
        self._shm_domain = shm.domain()

    # ---------------------------------------------------------------- helpers

    @property
    def hosted(self) -> Any:
        """The hosted object (None until constructed)."""
        return self._obj

    def _err(self, exc: errors.PodiumError) -> errors.PodiumError:
        if exc.rank < 0:
            exc.rank = self.config.rank
        return exc

    def _decode_payload(self, header: worker_pb2.CallHeader, payload: Any, stream: "_CallStream") -> Any:
        if header.shm_name:
            if header.shm_pooled:
                payload = stream.shm.cache.read(header.shm_name, header.payload_size,
                                                self.config.max_payload_bytes)
            else:
                payload = shm.read_segment(header.shm_name, max_size=self.config.max_payload_bytes)
            self.stats["shm_in"] += 1
        return codec.decode(payload)

    def _lookup(self, name: str) -> tuple[Any, bool, bool]:
        """(bound method, is_async, materialize_futures) or UnknownMethodError."""
        obj = self._obj
        if name == RAY_CALL:
            return self._ray_call, False, True
        if not name or name.startswith("__"):
            raise errors.UnknownMethodError(f"{self._class_name} has no callable method {name!r}",
                                            details={"method": name})
        try:
            fn = getattr(obj, name)
        except AttributeError:
            fn = None
        if fn is None or not callable(fn):
            close = _close_names(name, obj)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise errors.UnknownMethodError(
                f"{self._class_name} has no method {name!r}{hint}",
                details={"method": name, "close_names": ",".join(close)})
        info = self._method_info.get(name)
        if info is None:
            from podium.worker.decorator import _is_async, get_registration

            reg = get_registration(fn)
            materialize = True if reg is None else bool(reg.get("materialize_futures", True))
            info = (_is_async(fn), materialize)
            self._method_info[name] = info
        return fn, info[0], info[1]

    def _ray_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # verl's escape hatch (actor.__ray_call__.remote(fn, ...)): fn(obj, ...) on the
        # execution thread; a coroutine it returns runs on the loop.
        result = fn(self._obj, *args, **kwargs)
        if inspect.iscoroutine(result):
            result = asyncio.run_coroutine_threadsafe(result, self._loop).result()
        return result

    def package(self, value: Any, header: worker_pb2.CallHeader,
                pool: shmpool.SegmentPool | None = None) -> _Outcome:
        """Encode a result and hold it, put it in shared memory (``pool``'s segments when
        it has room, else a one-shot segment), or ready it for streaming."""
        encoded = _ENCODED_NONE if value is None else codec.encode(value)  # most methods return None
        nbytes = encoded.nbytes
        if header.hold_result:
            rows = refs.rows_of(value)
            self.held.check_room(nbytes)
            frozen = _Frozen(encoded.to_segments(), nbytes)
            # The held value is a snapshot (decoded from the frozen copy) unless nothing can
            # change it anyway (None, numbers, strings: most small results).
            snapshot = value if type(value) in _IMMUTABLE_RESULTS else codec.decode(frozen.buffer)
            held = self.held.put(snapshot, frozen, nbytes, rows)
            return _Outcome(ref=worker_pb2.ObjectRefInfo(
                object_id=held.object_id, worker_id=self.config.worker_id,
                owner_address=self.address, owner_rank=self.config.rank,
                size_bytes=nbytes, rows=rows,
                # Small results ride along, so the caller's get() needs no Fetch.
                inline_value=bytes(frozen.buffer) if nbytes <= self.config.inline_result_bytes else b""))
        segments = encoded.to_segments()
        if header.reply_in_shm and nbytes >= self.config.shm_threshold_bytes:
            try:
                name = pool.write(segments, nbytes) if pool is not None else None
                if name:
                    self.stats["shm_out"] += 1
                    return _Outcome(shm_name=name, shm_pooled=True, nbytes=nbytes)
                name, size = shm.write_segments(segments)
            except OSError as exc:  # /dev/shm full or missing: TCP still works
                log.warning("shared memory unavailable (%s); replying over TCP", exc)
            else:
                self.stats["shm_out"] += 1
                return _Outcome(shm_name=name, nbytes=size)
        return _Outcome(segments=segments, nbytes=nbytes)

    def _invoke_sync(self, fn: Any, args: list, kwargs: dict, header: worker_pb2.CallHeader,
                     pool: shmpool.SegmentPool | None) -> _Outcome:
        # Runs on the execution thread.
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - user code; reported, worker keeps serving
            raise _call_error(fn, args, kwargs, exc, self.config.rank, self.config.node_address) from None
        return self.package(value, header, pool)

    def _construct_sync(self, cls_ref: Any, args: Any, kwargs: Any) -> None:
        # Runs on the execution thread: CUDA/NCCL state made here belongs to it.
        from podium.worker.factory import resolve_class

        cls = resolve_class(cls_ref)
        self._class_name = f"{cls.__module__}.{cls.__qualname__}"
        try:
            obj = cls(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - user code
            raise _remote_error(exc, self.config.rank, self.config.node_address) from None
        self._obj = obj

    # ---------------------------------------------------------------- calls

    def reserve_gate(self) -> tuple[asyncio.Future, asyncio.Future]:
        """(predecessor's gate, this call's gate); see ``__init__``."""
        prev, mine = self._gate, self._loop.create_future()
        self._gate = mine
        return prev, mine

    @staticmethod
    def open_gate(prev: asyncio.Future, mine: asyncio.Future) -> None:
        """Complete ``mine`` once ``prev`` is complete (never before it)."""
        if mine.done():
            return
        if prev.done():
            mine.set_result(None)
        else:
            prev.add_done_callback(lambda _: mine.done() or mine.set_result(None))

    async def run_construct(self, active: "_Active", payload: Any) -> None:
        """CONSTRUCT: decode (cls_ref, args, kwargs) and build the object on the execution thread."""
        prev, mine = active.gates
        try:
            try:
                value = self._decode_payload(active.header, payload, active.stream)
                if not (isinstance(value, (tuple, list)) and len(value) == 3):
                    raise errors.InvalidArgumentError(
                        "a CONSTRUCT payload must decode to (class_or_import_path, args, kwargs), "
                        f"got {type(value).__name__}")
                cls_ref, args, kwargs = value
                if not prev.done():
                    await prev
                if active.cancelled:
                    raise errors.CancelledError("construct cancelled before it started")
                job = self._exec.submit(self._construct_sync, cls_ref, tuple(args), dict(kwargs))
                active.job = job
            finally:
                self.open_gate(prev, mine)
            await job.future
        except BaseException as exc:
            self._construct_state = "failed"
            self._construct_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            if not self._construct_done.done():
                self._construct_done.set_result(False)
            raise
        self._construct_state = "done"
        self._construct_done.set_result(True)
        log.info("constructed %s (rank %d)", self._class_name, self.config.rank)
        await active.stream.send_outcome(active.call_id, _Outcome(segments=codec.encode(None).to_segments()))

    def start_fast(self, stream: "_CallStream", call_id: int, header: worker_pb2.CallHeader,
                   data: bytes) -> Any:
        """Hand a one-frame CALL of a sync method to the execution thread right now.

        The common call needs none of :meth:`run_call`'s waiting: the object is built, no
        earlier call waits for its arguments (the gate is open), no argument is a ref to
        fetch. Then there is no task, gate or future per call; the outcome is written from
        the loop when the thread reports it (``stream.fast_done``). Returns True if started,
        else the decoded payload (or None) for :meth:`run_call`, which also reports every
        error.
        """
        try:
            value = codec.decode(data)
        except Exception:  # noqa: BLE001 - run_call decodes again and reports it
            return None
        if type(value) is not tuple or len(value) != 2:
            return value
        args, kwargs = value
        try:
            fn, is_async, materialize = self._lookup(header.method)
        except Exception:  # noqa: BLE001 - run_call looks up again and reports it
            return value
        if is_async or (materialize and (any(map(refs.is_ref, args))
                                         or any(map(refs.is_ref, kwargs.values())))):
            return value
        active = _Active(call_id, header, stream, None)
        if active.deadline and time.monotonic() > active.deadline:
            return value
        stats = self.stats
        stats["bytes_in"] += header.payload_size
        stats["calls"] += 1
        stats["calls_in_flight"] += 1
        active.started = time.monotonic()
        stream.active[call_id] = active
        active.job = self._exec.submit_reporting(
            self._invoke_sync, (fn, args, kwargs, header, stream.shm.pool), stream.fast_done, active)
        return True

    def precondition_for_call(self) -> None:
        """FailedPreconditionError unless a constructor ran or is queued."""
        state = self._construct_state
        if state == "none":
            raise errors.FailedPreconditionError(
                "this worker has no object yet: CONSTRUCT must come before any CALL")
        if state == "failed":
            raise errors.FailedPreconditionError(
                f"this worker's constructor failed ({self._construct_error}); tear it down")

    async def run_call(self, active: "_Active", payload: Any, decoded: Any = None) -> None:
        """CALL: decode (unless ``decoded`` is the value already), look up, materialize refs,
        run (thread or loop), package, reply."""
        prev, mine = active.gates
        header = active.header
        job = None
        try:
            value = (self._decode_payload(header, payload, active.stream) if decoded is None
                     else decoded)
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                raise errors.InvalidArgumentError(
                    f"a CALL payload must decode to (args, kwargs), got {type(value).__name__}")
            args, kwargs = value
            if self._construct_state == "pending":
                await self._construct_done
            self.precondition_for_call()
            fn, is_async, materialize = self._lookup(header.method)
            if materialize and (any(map(refs.is_ref, args)) or any(map(refs.is_ref, kwargs.values()))):
                args, kwargs = await self._materialize(active, args, kwargs)
            if is_async:
                self.open_gate(prev, mine)
            else:
                if not prev.done():
                    await prev
                if active.cancelled:
                    raise errors.CancelledError(f"call {header.method!r} cancelled before it started")
                if active.deadline and time.monotonic() > active.deadline:
                    raise errors.DeadlineExceededError(
                        f"call {header.method!r} reached its deadline before it started")
                job = self._exec.submit(self._invoke_sync, fn, args, kwargs, header, active.stream.shm.pool)
                active.job = job
        finally:
            self.open_gate(prev, mine)
        self.stats["calls"] += 1
        if job is not None:
            outcome = await job.future
        else:
            try:
                result = await fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - user code
                raise _call_error(fn, args, kwargs, exc, self.config.rank, self.config.node_address) from None
            outcome = self.package(result, header, active.stream.shm.pool)
        await active.stream.send_outcome(active.call_id, outcome)

    async def _materialize(self, active: "_Active", args: Any, kwargs: Any) -> tuple[list, dict]:
        """Fetch top-level ref arguments from their owners, within the call's deadline."""
        method = active.header.method
        try:
            if active.deadline:
                return await asyncio.wait_for(refs.materialize(args, kwargs),
                                              max(0.0, active.deadline - time.monotonic()))
            return await refs.materialize(args, kwargs)
        except asyncio.TimeoutError:
            raise errors.DeadlineExceededError(
                f"fetching the arguments of {method!r} did not finish within the call's deadline") from None
        except errors.UnavailableError as exc:
            # The owner of an argument is gone, not this worker: a distinct class, so the
            # caller does not mistake it for this worker's death.
            raise errors.DataLossError(
                f"rank {self.config.rank} could not fetch an argument of {method!r} from its "
                f"owner: {exc}", details={"cause": type(exc).__name__}) from None

    async def Calls(self, request_iterator, context):
        """The call stream: CallFrames in, ReplyFrames out (interleaved by call_id)."""
        await _CallStream(self, context).run()

    # ---------------------------------------------------------------- unary RPCs

    @rpc.handle_errors
    async def Describe(self, request, context):
        """Identity, state and method table of the hosted object."""
        methods = []
        if self._obj is not None:
            from podium.worker.decorator import method_table

            for row in method_table(self._obj):
                payload = b""
                if row.get("dispatch_mode") == "CUSTOM":
                    payload = cloudpickle.dumps(row.get("dispatch"))
                methods.append(worker_pb2.MethodInfo(
                    name=row["name"], dispatch_mode=row.get("dispatch_mode") or "",
                    execute_mode=row.get("execute_mode") or "", blocking=bool(row.get("blocking", True)),
                    materialize_futures=bool(row.get("materialize_futures", True)),
                    is_async=bool(row.get("is_async", False)), registered=bool(row.get("registered")),
                    dispatch_payload=payload))
        return worker_pb2.DescribeResponse(
            worker_id=self.config.worker_id, rank=self.config.rank, world_size=self.config.world_size,
            pid=os.getpid(), class_name=self._class_name, constructed=self._construct_state == "done",
            methods=methods, node_address=self.config.node_address, hostname=self._hostname,
            shm_domain=self._shm_domain,
            call_port=self.call_port, stats=self.stats)

    def fetch_value(self, object_id: str, rows: tuple[int, int] | None) -> tuple[Any, Any]:
        """(value, Encoded) of a held object or a row range of it."""
        held = self.held.get(object_id)
        if rows is None:
            return held.value, held.encoded
        value = refs.slice_rows(held.value, rows[0], rows[1])
        return value, codec.encode(value)

    @rpc.handle_errors
    async def Fetch(self, request, context):
        """Stream a held result (or a row range of it) in chunks or through shared memory."""
        rows = (request.row_start, request.row_stop) if request.has_rows else None
        _, encoded = self.fetch_value(request.object_id, rows)
        segments = encoded.to_segments()
        total = encoded.nbytes
        self.stats["fetches_served"] += 1
        self.stats["bytes_served"] += total
        if request.reply_in_shm:
            try:
                name, size = await asyncio.to_thread(shm.write_segments, segments)
            except OSError as exc:  # /dev/shm full or missing: TCP still works
                log.warning("shared memory unavailable (%s); serving the fetch over TCP", exc)
            else:
                self.stats["shm_out"] += 1
                yield worker_pb2.DataChunk(total_size=size, shm_name=name)
                return
        first = True
        for chunk in framing.iter_chunks(segments):
            yield worker_pb2.DataChunk(total_size=total if first else 0, data=bytes(chunk))
            first = False

    @rpc.handle_errors
    async def Release(self, request, context):
        """Drop held results."""
        return worker_pb2.ReleaseResponse(released=self.held.release(request.object_ids))

    @rpc.handle_errors
    async def Shutdown(self, request, context):
        """Answer, then stop the process shortly after."""
        log.info("shutdown requested: %s", request.reason or "(no reason given)")
        self._loop.call_later(0.05, self.stopping.set)
        return worker_pb2.ShutdownResponse()

    def close(self) -> None:
        """Stop taking work; a running user call is left to finish on its own thread."""
        self._exec.stop()
        self.held.clear()


# --------------------------------------------------------------------------- one stream


class _Active:
    __slots__ = ("call_id", "header", "stream", "gates", "job", "cancelled", "deadline", "task", "started")

    def __init__(self, call_id: int, header: worker_pb2.CallHeader, stream: "_CallStream",
                 gates: tuple[asyncio.Future, asyncio.Future]) -> None:
        self.call_id = call_id
        self.header = header
        self.stream = stream
        self.gates = gates
        self.job: _Job | None = None
        self.cancelled = False
        self.deadline = time.monotonic() + header.timeout_seconds if header.timeout_seconds > 0 else 0.0
        self.task: asyncio.Task | None = None
        #: monotonic() when a fast-path call started (start_fast), for the stats.
        self.started = 0.0


class _Incoming:
    __slots__ = ("header", "assembler")

    def __init__(self, header: worker_pb2.CallHeader, assembler: framing.Assembler | None) -> None:
        self.header = header
        self.assembler = assembler  # None: discarding the rest of a refused call


class _CallStream:
    """One client's Calls stream: assembles CallFrames, runs calls, writes replies."""

    def __init__(self, host: WorkerServicer, context) -> None:
        self.host = host
        self.context = context
        self.incoming: dict[int, _Incoming] = {}
        self.active: dict[int, _Active] = {}
        self.lock = asyncio.Lock()
        #: Reused shared-memory segments, both ways (used only by a same-host client).
        self.shm = shmpool.SharedSegments(asyncio.get_running_loop(), worker_pb2.ReplyFrame,
                                          self._send_quietly)
        from podium import rawcall

        # Replies written without awaiting (the fast path) need the raw connection's
        # write_nowait; on the gRPC stream every call takes the general path.
        self.writes_nowait = isinstance(context, rawcall.FrameConnection)
        self.fast_done = self._fast_done  # one bound method for every fast call
        self._fast_finished: asyncio.Future | None = None

    async def run(self) -> None:
        context = self.context
        try:
            while True:
                frame = await context.read()
                if frame is grpc.aio.EOF:
                    break
                if isinstance(frame, rpc.MalformedMessage):  # a peer's garbage bytes
                    await rpc.abort(context, frame.error)
                decoded = self.try_fast(frame)
                if decoded is True:
                    continue
                await self.on_frame(frame, decoded)
            # The client half-closed: let the calls in flight answer.
            while True:
                tasks = [a.task for a in self.active.values() if a.task is not None and not a.task.done()]
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
                elif any(a.task is None for a in self.active.values()):
                    # fast-path calls (no task): each one that finishes wakes this
                    self._fast_finished = asyncio.get_running_loop().create_future()
                    await self._fast_finished
                else:
                    break
        finally:
            for active in list(self.active.values()):
                if active.job is not None:
                    self.host._exec.cancel(active.job)
                if active.task is not None and not active.task.done():
                    active.task.cancel()
            self.shm.close()

    async def write(self, frame: worker_pb2.ReplyFrame) -> None:
        async with self.lock:
            await self.context.write(frame)

    def _send_quietly(self, frame: worker_pb2.ReplyFrame) -> None:
        # Segment bookkeeping: lost with a broken stream, as the stream's pool is.
        asyncio.get_running_loop().create_task(self._write_quietly(frame))

    async def _write_quietly(self, frame: worker_pb2.ReplyFrame) -> None:
        try:
            await self.write(frame)
        except Exception:  # noqa: BLE001 - the stream broke: the pool goes with it
            pass

    def try_fast(self, frame: worker_pb2.CallFrame) -> Any:
        """Start a one-frame CALL through :meth:`WorkerServicer.start_fast` when it can
        take it: True if started; otherwise the decoded payload or None, for on_frame."""
        if not (self.writes_nowait and frame.last and frame.HasField("header")) or frame.shm_released \
                or frame.shm_forget:
            return None
        header = frame.header
        host = self.host
        call_id = frame.call_id
        if (header.kind != _CALL or header.shm_name or host._construct_state != "done"
                or not host._gate.done() or call_id in self.active or call_id in self.incoming
                or self.context.must_drain):
            return None
        data = frame.data
        if len(data) != header.payload_size or len(data) > host.config.max_payload_bytes:
            return None  # on_frame's Assembler says what is wrong
        return host.start_fast(self, call_id, header, data)

    def _fast_done(self, active: _Active, ok: bool, result: Any) -> None:
        """The execution thread finished a fast-path call (on the loop): reply."""
        stats = self.host.stats
        stats["calls_in_flight"] -= 1
        stats["call_seconds"] += time.monotonic() - active.started
        call_id = active.call_id
        self.active.pop(call_id, None)
        try:
            if not ok:
                stats["call_errors"] += 1
                self.context.write_nowait(self._error_frame(call_id, result))
            else:
                frame = self._single_frame(call_id, result)
                if frame is not None:
                    self.context.write_nowait(frame)
                else:  # a large result streams in chunks: that needs awaiting
                    self.spawn(active, self._reply_later(active, result))
        except errors.PodiumError:
            pass  # the connection is closed: nobody to tell
        finished = self._fast_finished
        if finished is not None and not finished.done():
            finished.set_result(None)

    async def _reply_later(self, active: _Active, outcome: _Outcome) -> None:
        try:
            await self.send_outcome(active.call_id, outcome)
        except Exception:  # noqa: BLE001 - the stream is gone; nobody to tell
            pass
        finally:
            self.active.pop(active.call_id, None)

    def _error_frame(self, call_id: int, exc: BaseException) -> worker_pb2.ReplyFrame:
        if not isinstance(exc, errors.PodiumError):
            log.exception("internal error in call %d", call_id, exc_info=exc)
            exc = errors.InternalError(f"worker host: {type(exc).__name__}: {exc}")
        self.host._err(exc)
        return worker_pb2.ReplyFrame(
            call_id=call_id, header=worker_pb2.ReplyHeader(ok=False, error=rpc.error_info_of(exc)),
            last=True)

    async def send_error(self, call_id: int, exc: BaseException) -> None:
        await self.write(self._error_frame(call_id, exc))

    def _single_frame(self, call_id: int, outcome: _Outcome) -> worker_pb2.ReplyFrame | None:
        """The one reply frame of ``outcome`` (counted in bytes_out), or None when it
        streams in chunks."""
        if outcome.ref is not None:
            header = worker_pb2.ReplyHeader(ok=True, ref=outcome.ref)
            frame = worker_pb2.ReplyFrame(call_id=call_id, header=header, last=True)
        elif outcome.shm_name:
            header = worker_pb2.ReplyHeader(ok=True, payload_size=outcome.nbytes, shm_name=outcome.shm_name,
                                            shm_pooled=outcome.shm_pooled)
            frame = worker_pb2.ReplyFrame(call_id=call_id, header=header, last=True)
        elif outcome.nbytes <= framing.CHUNK_SIZE:
            header = worker_pb2.ReplyHeader(ok=True, payload_size=outcome.nbytes)
            frame = worker_pb2.ReplyFrame(call_id=call_id, header=header, data=b"".join(outcome.segments),
                                          last=True)
        else:
            return None
        self.host.stats["bytes_out"] += outcome.nbytes
        return frame

    async def send_outcome(self, call_id: int, outcome: _Outcome) -> None:
        frame = self._single_frame(call_id, outcome)
        if frame is not None:
            await self.write(frame)
            return
        self.host.stats["bytes_out"] += outcome.nbytes
        header = worker_pb2.ReplyHeader(ok=True, payload_size=outcome.nbytes)
        chunks = framing.iter_chunks(outcome.segments)
        pending = bytes(next(chunks))
        first = True
        for chunk in chunks:
            await self.write(worker_pb2.ReplyFrame(call_id=call_id, header=header if first else None,
                                                   data=pending))
            first = False
            pending = bytes(chunk)
        await self.write(worker_pb2.ReplyFrame(call_id=call_id, header=header if first else None,
                                               data=pending, last=True))

    async def on_frame(self, frame: worker_pb2.CallFrame, decoded: Any = None) -> None:
        """Any frame: a cancel, a call's header, or a data chunk (``decoded``: the one-frame
        payload try_fast already decoded, or None)."""
        call_id = frame.call_id
        if frame.shm_released or frame.shm_forget:
            self.shm.on_frame(frame)
        if call_id == 0 and not frame.HasField("header"):  # segment bookkeeping only
            return
        if frame.HasField("header"):
            header = frame.header
            if header.kind == _CANCEL:
                await self.cancel(call_id)
                return
            if call_id in self.incoming or call_id in self.active:
                await self.send_error(call_id, errors.InvalidArgumentError(
                    f"call id {call_id} is already in use on this stream"))
                return
            if header.kind not in (_CALL, _CONSTRUCT):
                await self.refuse(call_id, header, frame.last, errors.InvalidArgumentError(
                    f"unknown call kind {header.kind}"))
                return
            if header.shm_name:
                if frame.last:
                    self.start(call_id, header, None)
                else:
                    await self.refuse(call_id, header, frame.last, errors.InvalidArgumentError(
                        "a call with shm_name carries no data frames"))
                return
            try:
                assembler = framing.Assembler(header.payload_size, self.host.config.max_payload_bytes)
            except errors.PodiumError as exc:
                await self.refuse(call_id, header, frame.last, exc)
                return
            incoming = _Incoming(header, assembler)
            if not frame.last:
                self.incoming[call_id] = incoming
        else:
            incoming = self.incoming.get(call_id)
            if incoming is None:
                await self.send_error(call_id, errors.DataLossError(
                    f"data frame for call {call_id}, which has no header on this stream"))
                return
            if frame.last:
                del self.incoming[call_id]
            if incoming.assembler is None:  # the rest of a refused call
                return
        try:
            incoming.assembler.add(frame.data)
            if frame.last:
                payload = incoming.assembler.result()
        except errors.PodiumError as exc:
            if not frame.last:
                incoming.assembler = None
            await self.send_error(call_id, exc)
            return
        if frame.last:
            self.start(call_id, incoming.header, payload, decoded)

    async def refuse(self, call_id: int, header, last: bool, exc: errors.PodiumError) -> None:
        if not last:
            self.incoming[call_id] = _Incoming(header, None)
        await self.send_error(call_id, exc)

    def start(self, call_id: int, header: worker_pb2.CallHeader, payload: Any, decoded: Any = None) -> None:
        host = self.host
        host.stats["bytes_in"] += header.payload_size
        active = _Active(call_id, header, self, host.reserve_gate())
        if header.kind == _CONSTRUCT:
            if host._construct_state in ("pending", "done"):
                host.open_gate(*active.gates)
                self.spawn(active, self.send_error(call_id, errors.FailedPreconditionError(
                    "this worker already has an object (CONSTRUCT runs once)")))
                return
            host._construct_state = "pending"
            body = host.run_construct(active, payload)
        else:
            body = host.run_call(active, payload, decoded)
        self.spawn(active, self.guard(active, body))

    def spawn(self, active: _Active, coro) -> None:
        self.active[active.call_id] = active
        active.task = asyncio.get_running_loop().create_task(coro)

    async def guard(self, active: _Active, body) -> None:
        stats = self.host.stats
        stats["calls_in_flight"] += 1
        started = time.monotonic()
        try:
            await body
        except asyncio.CancelledError:
            stats["call_errors"] += 1
            raise
        except BaseException as exc:  # noqa: BLE001 - becomes the call's error reply
            stats["call_errors"] += 1
            try:
                await self.send_error(active.call_id, exc)
            except Exception:  # noqa: BLE001 - the stream is gone; nobody to tell
                pass
        finally:
            stats["calls_in_flight"] -= 1
            stats["call_seconds"] += time.monotonic() - started
            self.active.pop(active.call_id, None)

    async def cancel(self, call_id: int) -> None:
        incoming = self.incoming.get(call_id)
        if incoming is not None and incoming.assembler is not None:
            incoming.assembler = None  # drop what arrived and what is still coming
            await self.send_error(call_id, errors.CancelledError(f"call {call_id} cancelled"))
            return
        active = self.active.get(call_id)
        if active is None:
            return
        active.cancelled = True
        if active.job is not None:
            self.host._exec.cancel(active.job)  # only succeeds when it has not started


# --------------------------------------------------------------------------- refs


class HostResolver:
    """Fetches refs for code in this worker: from its own store, or from peers directly."""

    def __init__(self, host: WorkerServicer, token: str, tls: TlsConfig | None = None) -> None:
        self._host = host
        self._token = token
        self._tls = tls
        self._loop = asyncio.get_running_loop()
        self._clients: dict[str, Any] = {}

    async def fetch(self, ref: refs.ObjectRef, rows: tuple[int, int] | None = None) -> Any:
        """The value of ``ref`` (or rows of it); a copy, so callers may mutate it."""
        host = self._host
        if ref.owner_address == host.address:
            _, encoded = host.fetch_value(ref.object_id, rows)
            return codec.decode(bytearray(b"".join(encoded.to_segments())))
        client = self._clients.get(ref.owner_address)
        if client is None:
            from podium.worker.client import WorkerClient

            client = WorkerClient(ref.owner_address, self._token, rank=ref.owner_rank,
                                  worker_id=ref.worker_id, tls=self._tls)
            self._clients[ref.owner_address] = client
        value = await client.fetch(ref, rows)
        host.stats["fetches_made"] += 1
        host.stats["bytes_fetched"] += client.last_fetch_bytes
        return value

    def run_sync(self, coro, timeout: float | None) -> Any:
        """Run ``coro`` on the host's loop from another thread (the execution thread)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coro.close()
            raise errors.FailedPreconditionError(
                "a blocking .get() was called on the worker's event loop (inside an async "
                "method): use 'await future.aget()' there")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise errors.DeadlineExceededError(f"fetching refs took longer than {timeout} s") from None

    async def close(self) -> None:
        """Close the peer clients."""
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()


# --------------------------------------------------------------------------- running


_current: WorkerServicer | None = None


def current_host() -> WorkerServicer | None:
    """The servicer of the host running in this process (None outside a worker)."""
    return _current


@dataclasses.dataclass
class RunningHost:
    """A started worker host: its server, servicer and port."""

    server: grpc.aio.Server
    servicer: WorkerServicer
    resolver: HostResolver
    port: int
    host: str
    #: The raw call socket's server (podium.rawcall), None where there is none (TLS).
    call_server: Any = None

    @property
    def address(self) -> str:
        """"host:port" clients connect to."""
        return self.servicer.address

    async def wait_stopping(self) -> None:
        """Return once SIGTERM or a Shutdown RPC asked this host to stop."""
        await self.servicer.stopping.wait()

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds) and drop held results."""
        global _current
        if self.call_server is not None:
            self.call_server.close()  # no new connections
            for conn in list(self.servicer.raw_connections):
                conn.close()  # and the open ones end, as the gRPC server's streams do
        await self.server.stop(grace)
        await self.resolver.close()
        self.servicer.close()
        if refs._resolver is self.resolver:
            refs.set_resolver(None)
        if _current is self.servicer:
            _current = None


async def start_host(address: str = "127.0.0.1", token: str | None = None,
                     env: Mapping[str, str] | None = None, *, port: int = 0,
                     tls: TlsConfig | None = None) -> RunningHost:
    """Start a worker host in this process's running loop, bound on ``address:port``.

    ``env`` supplies RANK, WORLD_SIZE, PODIUM_WORKER_ID and the byte limits
    (default: os.environ); ``token`` defaults to the cluster token lookup.
    Installs the host's ref resolver process-wide.
    """
    global _current
    token = resolve_token(token)
    config = HostConfig.from_env(env, address=address)
    servicer = WorkerServicer(config)
    server, health = rpc.make_server(token)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    bound = rpc.bind(server, address, port, tls)
    servicer.address = f"[{address}]:{bound}" if ":" in address else f"{address}:{bound}"
    await rpc.start_server(server, health)
    call_server = None
    if tls is None and os.environ.get("PODIUM_RAW_CALLS", "1") != "0":
        # The fast path of the Calls stream (podium.rawcall); with TLS, gRPC only.
        from podium import rawcall

        def on_connection(conn: Any) -> None:
            servicer.raw_connections.add(conn)
            task = asyncio.get_running_loop().create_task(_CallStream(servicer, conn).run())
            task.add_done_callback(lambda t: (conn.close(), servicer.raw_connections.discard(conn),
                                              t.cancelled() or t.exception()))

        call_server, servicer.call_port = await rawcall.serve(
            address, token, worker_pb2.CallFrame.FromString, on_connection)
    resolver = HostResolver(servicer, token, tls)
    refs.set_resolver(resolver)
    _current = servicer
    return RunningHost(server=server, servicer=servicer, resolver=resolver, port=bound, host=address,
                       call_server=call_server)


def _write_ready(fd: int, port: int) -> None:
    data = (json.dumps({"port": port}) + "\n").encode()
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


async def _serve(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("PODIUM_NODE_ADDRESS") or "127.0.0.1"
    # The agent passes its TLS files (podium.worker.spawner.worker_env): with them this
    # worker serves mutual TLS and fetches from its peers over it.
    tls = TlsConfig.from_paths(os.environ.get("PODIUM_TLS_CERT"), os.environ.get("PODIUM_TLS_KEY"),
                               os.environ.get("PODIUM_TLS_CA"))
    running = await start_host(address, os.environ.get("PODIUM_TOKEN") or None, os.environ, tls=tls)
    # Start-up phases, epoch seconds, for whoever measures cold start (the bench reads
    # PODIUM_*_AT): agent asked (SPAWN_REQUESTED), forked (FORKED, fork server only),
    # host code running (HOST_MAIN), gRPC and raw call servers up (SERVING).
    os.environ["PODIUM_SERVING_AT"] = repr(time.time())
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, running.servicer.stopping.set)
    log.info("worker %s rank %s serving on %s (pid %d)", running.servicer.config.worker_id or "-",
             running.servicer.config.rank, running.address, os.getpid())
    if args.ready_fd is not None:
        _write_ready(args.ready_fd, running.port)
    await running.wait_stopping()
    log.info("stopping")
    await running.stop(grace=1.0)
    return 0


def _exit_watchdog(seconds: float) -> None:
    # A user method stuck in native code keeps the execution thread alive and
    # would block interpreter exit forever; the agent must see us go.
    def run() -> None:
        time.sleep(seconds)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    threading.Thread(target=run, name="podium-exit-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker process (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m podium.worker.host",
                                     description="Podium worker process (started by a node agent)")
    parser.add_argument("--ready-fd", type=int, default=None,
                        help='write {"port": N} to this fd once serving, then close it')
    parser.add_argument("--address", default=None,
                        help="address to bind (default: $PODIUM_NODE_ADDRESS or 127.0.0.1)")
    args = parser.parse_args(argv)
    os.environ["PODIUM_HOST_MAIN_AT"] = repr(time.time())
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{os.environ.get('RANK', '?')} %(levelname)s "
                               f"%(name)s: %(message)s")
    rpc.use_uvloop()
    try:
        code = asyncio.run(_serve(args))
    except errors.PodiumError as exc:  # bad token, address or limits: one clear line for the agent
        log.error("worker failed to start: %s: %s", type(exc).__name__, exc)
        return 2
    _exit_watchdog(5.0)
    return code


if __name__ == "__main__":
    # Run the importable module, not this __main__ copy: user code that imports
    # podium.worker.host (current_host()) must see the running host's state.
    from podium.worker import host as _host

    sys.exit(_host.main())
