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

from podium import codec, errors, refs, rpc
from podium.transport import chunks
from podium.transport import shm
from podium.transport import shmpool
from podium.auth import TlsConfig, resolve_token
from podium.v1 import worker_pb2, worker_pb2_grpc
from podium.worker.host.callstream import ActiveCall, CallStream
from podium.worker.host import gpucap
from podium.worker.host.execthread import ExecutionThread
from podium.worker.host.heldstore import HeldStore, default_budget

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
    #: shm_name is a segment of the stream's pool (podium.transport.shmpool), not a one-shot one.
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
    # A CUDA OOM under a Podium memory cap names the cap (not just torch's numbers).
    message = gpucap.oom_message(exc) or str(exc)
    return errors.RemoteError(message, traceback=text, remote_type=name, rank=rank, node=node)


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


# --------------------------------------------------------------------------- servicer


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """The ``podium.v1.Worker`` service around one hosted object."""

    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self.held = HeldStore(config.hold_budget_bytes)
        #: "host:port" peers use to reach this worker (set once bound).
        self.address = ""
        #: Port of the raw call socket (podium.transport.callsocket) on the same address; 0: none.
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

    def _decode_payload(self, header: worker_pb2.CallHeader, payload: Any, stream: CallStream) -> Any:
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

    async def run_construct(self, active: ActiveCall, payload: Any) -> None:
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

    def start_fast(self, stream: CallStream, call_id: int, header: worker_pb2.CallHeader,
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
        active = ActiveCall(call_id, header, stream, None)
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

    async def run_call(self, active: ActiveCall, payload: Any, decoded: Any = None) -> None:
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

    async def _materialize(self, active: ActiveCall, args: Any, kwargs: Any) -> tuple[list, dict]:
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
        await CallStream(self, context).run()

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
        for chunk in chunks.iter_chunks(segments):
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
    #: The raw call socket's server (podium.transport.callsocket), None where there is none (TLS).
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
    # The opt-in GPU memory cap goes on before any payload is decoded or user code runs.
    cap = gpucap.apply_from_env(os.environ if env is None else env)
    servicer = WorkerServicer(config)
    servicer.stats.update(cap.stats())
    server, health = rpc.make_server(token)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    bound = rpc.bind(server, address, port, tls)
    servicer.address = f"[{address}]:{bound}" if ":" in address else f"{address}:{bound}"
    await rpc.start_server(server, health)
    call_server = None
    if tls is None and os.environ.get("PODIUM_RAW_CALLS", "1") != "0":
        # The fast path of the Calls stream (podium.transport.callsocket); with TLS, gRPC only.
        from podium.transport import callsocket

        def on_connection(conn: Any) -> None:
            servicer.raw_connections.add(conn)
            task = asyncio.get_running_loop().create_task(CallStream(servicer, conn).run())
            task.add_done_callback(lambda t: (conn.close(), servicer.raw_connections.discard(conn),
                                              t.cancelled() or t.exception()))

        call_server, servicer.call_port = await callsocket.serve(
            address, token, worker_pb2.CallFrame.FromString, on_connection)
    resolver = HostResolver(servicer, token, tls)
    refs.set_resolver(resolver)
    _current = servicer
    return RunningHost(server=server, servicer=servicer, resolver=resolver, port=bound, host=address,
                       call_server=call_server)


def _write_ready(fd: int, port: int) -> None:
    line: dict[str, Any] = {"port": port}
    cap = gpucap.current()
    if cap.requested:  # the agent forwards it to the scheduler (/v1/placement)
        line["gpu_memory_cap"] = cap.ready_fields()
    data = (json.dumps(line) + "\n").encode()
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


async def _serve(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("PODIUM_NODE_ADDRESS") or "127.0.0.1"
    # The agent passes its TLS files (podium.worker.agent.spawner.worker_env): with them this
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
