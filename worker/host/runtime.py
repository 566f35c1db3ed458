"""The worker host's runtime: one hosted object, its calls, its held results (no gRPC here)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import time
import traceback
from collections.abc import AsyncIterator
from typing import Any

import cloudpickle

from podium import codec, errors, refs
from podium.tracering import RING, now_ns
from podium.transport import chunks, shm
from podium.v1 import worker_pb2
from podium.worker.actorshell import GROUP_CALL, READY_CALL, ActorShell, construct, set_host_loop
from podium.worker.caller.streaming import STREAM_CLOSE_CALL, STREAM_NEXT_CALL, declared_returns
from podium.worker.host.activecall import ActiveCall, CallOrigin
from podium.worker.host.admission import CallAdmission, Declined
from podium.worker.host.completion import CallBook
from podium.worker.host.config import FETCH_CALL, RAY_CALL, HostConfig
from podium.worker.host.decodeonce import DecodeFailed
from podium.worker.host.execthread import ExecutionThread
from podium.worker.host.heldstore import HeldStore
from podium.worker.host.invoke import SyncInvoker
from podium.worker.host.itemstreams import StreamCalls
from podium.worker.host.methodstats import MethodTable
from podium.worker.host.results import Outcome, call_error, close_names, remote_error
from podium.worker.processenv import WithProcessEnv

__all__ = ["HostRuntime"]

#: Longest a call waits for its actor's CONSTRUCT to arrive (the owner sends it right after
#: the worker started; get_actor waits as long for a handle's description).
CONSTRUCT_WAIT = 60.0
#: The most characters of a failed constructor's traceback that later calls' errors repeat.
MAX_CONSTRUCT_ERROR = 4000

log = logging.getLogger("podium.worker.host")

#: The host's own async calls, whose Podium errors reach the caller as they are.
_HOST_CALLS = frozenset({FETCH_CALL, STREAM_NEXT_CALL, STREAM_CLOSE_CALL})


async def _ready() -> bool:
    """READY_CALL's method: it runs once the constructor did (run_call waits for it)."""
    return True


class HostRuntime:
    """One hosted object and everything that runs it: construction, calls in order on the
    execution thread (or the loop for ``async def``), held results, the counters.

    It knows no gRPC: :class:`~podium.worker.host.servicer.WorkerServicer` is the thin service
    over it, and :class:`~podium.worker.host.callstream.CallStream` feeds it the calls of one
    connection, each admitted by :attr:`admission` (:mod:`podium.worker.host.admission`).
    """

    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self.held = HeldStore(config.hold_budget_bytes)
        #: Watches the processes that borrow held values (a BorrowerWatch, set by whoever
        #: serves this runtime; None: borrowers are not watched).
        self.borrower_watch: Any = None
        #: Port of the raw call socket (podium.transport.callsocket) on the same address; 0: none.
        self.call_port = 0
        #: Its open connections (closed when the host stops).
        self.raw_connections: set = set()
        #: Counters a test (or a user method, through current_host()) can read.
        self.stats = {"calls": 0, "fetches_served": 0, "bytes_served": 0,
                      "fetches_made": 0, "bytes_fetched": 0, "shm_in": 0, "shm_out": 0,
                      # Calls whose arguments came in a staged segment; results sent as
                      # references into the argument's segment (see SyncInvoker.package); large TCP
                      # replies sent from the method's memory, not a copy (LentReply); small
                      # replies sent by the execution thread itself (CallCompletion.send_from_thread).
                      "staged_in": 0, "in_place_out": 0, "lent_out": 0, "thread_replies": 0,
                      # The call path's counters (node agent /metrics): calls and constructs
                      # running now, finished with an error, seconds spent, payload bytes.
                      "calls_in_flight": 0, "call_errors": 0, "call_seconds": 0.0,
                      "bytes_in": 0, "bytes_out": 0,
                      # Payloads that came and went as bulk frames on the raw call socket.
                      "bulk_in": 0, "bulk_out": 0,
                      # Calls the execution thread read from the raw socket and ran itself
                      # (podium.worker.host.directcalls).
                      "direct_calls": 0}
        #: Runs sync methods and packages their values (the one way a call runs on the thread).
        self.invoker = SyncInvoker(config, self.held, self.stats)
        #: Per-method latency histograms and bytes (Describe's method_stats): the one book
        #: every call's ending is counted in (podium.worker.host.completion).
        self.methods = MethodTable()
        self.book = CallBook(self.stats, self.methods)
        self.stopping = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        set_host_loop(self._loop)  # an actor's async def __init__ runs here (actorshell.construct)
        self.exec_thread = ExecutionThread(self._loop)
        self._obj: Any = None
        self._class_name = ""
        self.construct_state = "none"  # none | pending | done | failed
        self._construct_done: asyncio.Future = self._loop.create_future()
        self._construct_arrived = asyncio.Event()
        #: Calls waiting for the CONSTRUCT to arrive (:meth:`construct_arrival`).
        self.waiting_for_construct = 0
        self._construct_error = ""
        #: When a call may start, in which order, and what can still stop it.
        self.admission = CallAdmission(self, self._loop)
        self._method_info: dict[str, tuple[bool, bool]] = {}
        self._hostname = socket.gethostname()
        self._shm_domain = shm.domain()
        self._returns: dict[str, tuple[int, int | None]] | None = None  # (declared_returns, once built)
        #: Streaming calls' items (num_returns="streaming"): podium.worker.host.itemstreams.
        self.streams = StreamCalls(self._loop, self.hold_value, self.held.release, config.rank,
                                   config.node_address, self.exec_thread.reads_on_loop)

    # ---------------------------------------------------------------- helpers

    @property
    def address(self) -> str:
        """"host:port" peers use to reach this worker (set once bound)."""
        return self.invoker.address

    @address.setter
    def address(self, value: str) -> None:
        self.invoker.address = value

    @property
    def hosted(self) -> Any:
        """The hosted object (None until constructed)."""
        return self._obj

    def with_rank(self, exc: errors.PodiumError) -> errors.PodiumError:
        if exc.rank < 0:
            exc.rank = self.config.rank
        return exc

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this host runs on."""
        return self._loop

    def hold_value(self, value: Any) -> worker_pb2.ObjectRefInfo:
        """Hold a snapshot of ``value`` in this host's store (``podium.put`` in a worker, the
        controller's object server) and return its ref's description."""
        contains: list[Any] = []
        with refs.exporting(contains):  # the refs inside live as long as the value is held
            ref = self.invoker.package(value, worker_pb2.CallHeader(hold_result=True)).ref
        assert ref is not None  # a held result always has one
        if contains:
            self.held.get(ref.object_id).contains = contains
        return ref

    def release_held(self, object_ids: list[str]) -> int:
        """Release held values (on the loop); how many there were."""
        return self.held.release(object_ids)

    def _decode_payload(self, header: worker_pb2.CallHeader, payload: Any, stream: CallOrigin) -> Any:
        if header.shm_name:
            payload = stream.conn.read_segment(header.shm_name, header.shm_pooled, header.payload_size,
                                               self.config.max_payload_bytes)
            self.stats["shm_in"] += 1
        if header.refs_segment:
            self.stats["staged_in"] += 1
            return codec.decode(payload, stream.conn.read_refs(header.refs_segment, header.refs,
                                                               self.config.max_payload_bytes))
        return codec.decode(payload)

    def lookup(self, name: str) -> tuple[Any, bool, bool]:
        """(bound method, is_async, materialize_futures) or UnknownMethodError."""
        obj = self._obj
        if name == RAY_CALL:
            return self._ray_call, False, True
        if name == FETCH_CALL:
            return self._fetch_call, True, False
        if not name or name.startswith("__"):
            if name == READY_CALL:  # (here, not above: dunder names only pay for it)
                return _ready, True, False
            if name.startswith("__podium_stream"):  # a streaming call, or its next or close
                return self.streams.lookup(name, self.lookup, obj)
            raise errors.UnknownMethodError(f"{self._class_name} has no callable method {name!r}",
                                            details={"method": name})
        try:
            fn = getattr(obj, name)
        except AttributeError:
            fn = None
        if fn is None or not callable(fn):
            if name == GROUP_CALL:  # (handle.method.options(concurrency_group=...): ActorShell has it)
                raise errors.UnknownMethodError(
                    f"{self._class_name} declares no concurrency_groups: a call cannot name a "
                    "concurrency group of it", details={"method": name})
            close = close_names(name, obj)
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

    def resolved(self, name: str) -> bool:
        """Whether :meth:`lookup` found ``name`` a method (the per-method counters count
        only those: a misspelt name gets no row)."""
        return name in self._method_info or name == RAY_CALL or name == FETCH_CALL

    def _ray_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # verl's escape hatch (actor.__ray_call__.remote(fn, ...)): fn(obj, ...) on the
        # execution thread; a coroutine it returns runs on the loop.
        result = fn(self._obj, *args, **kwargs)
        if inspect.iscoroutine(result):
            result = asyncio.run_coroutine_threadsafe(result, self._loop).result()
        return result

    def _construct_sync(self, header: worker_pb2.CallHeader, payload: Any, stream: CallOrigin) -> None:
        # Runs on the execution thread: CUDA/NCCL state made here belongs to it, and decoding
        # the payload here (a class by reference imports its module: verl's agent loop imports
        # for seconds) keeps the loop answering liveness pings and other calls meanwhile.
        from podium.worker.factory import resolve_class

        value = self._decode_payload(header, payload, stream)
        if not (isinstance(value, (tuple, list)) and len(value) == 3):
            raise errors.InvalidArgumentError(
                "a CONSTRUCT payload must decode to (class_or_import_path, args, kwargs), "
                f"got {type(value).__name__}")
        cls_ref, args, kwargs = value
        cls = resolve_class(cls_ref)
        self._returns = _declared_of(cls, args)  # (Describe tells it while the constructor runs)
        self._class_name = f"{cls.__module__}.{cls.__qualname__}"
        try:
            obj = construct(cls, tuple(args), dict(kwargs))  # an async def __init__ is awaited on the loop
        except BaseException as exc:  # noqa: BLE001 - user code
            raise remote_error(exc, self.config.rank, self.config.node_address) from None
        self._obj = obj

    # ---------------------------------------------------------------- calls

    async def run_construct(self, active: ActiveCall, payload: Any) -> None:
        """CONSTRUCT: decode (cls_ref, args, kwargs) and build the object on the execution thread."""
        assert active.gates is not None  # the general path's calls have gates
        prev, mine = active.gates
        admission = self.admission
        try:
            try:
                if not prev.done():
                    await prev
                admission.check_start(active, "construct")
                job = self.exec_thread.submit(self._construct_sync, active.header, payload, active.stream)
                active.job = job
            finally:
                admission.open_gate(prev, mine)
            assert job.future is not None  # submit() gives every job one
            await job.future
        except BaseException as exc:
            self.construct_state = "failed"
            # The traceback's tail too: a later call's error must say where it failed
            # (a framework that builds its actors without waiting sees only that error).
            self._construct_error = "".join(traceback.format_exception(exc))[-MAX_CONSTRUCT_ERROR:]
            if not self._construct_done.done():
                self._construct_done.set_result(False)
            raise
        self.construct_state = "done"
        self._construct_done.set_result(True)
        log.info("constructed %s (rank %d)", self._class_name, self.config.rank)
        await active.stream.send_outcome(active.call_id, Outcome(segments=codec.encode(None).to_segments()))

    def begin_construct(self) -> None:
        """A CONSTRUCT arrived (its gate reserved): calls waiting for it may start."""
        self.construct_state = "pending"
        self._construct_arrived.set()

    async def construct_arrival(self) -> None:
        """Until a CONSTRUCT arrived, at most CONSTRUCT_WAIT seconds: a handle passed to
        another process can call before the owner's CONSTRUCT is here (Ray queues such calls
        until the actor exists). After the bound the call gets the precondition error."""
        self.waiting_for_construct += 1
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._construct_arrived.wait(), CONSTRUCT_WAIT)
        finally:
            self.waiting_for_construct -= 1

    def precondition_for_call(self) -> None:
        """FailedPreconditionError unless a constructor ran or is queued."""
        state = self.construct_state
        if state == "none":
            raise errors.FailedPreconditionError(
                "this worker has no object yet: CONSTRUCT must come before any CALL")
        if state == "failed":
            raise errors.FailedPreconditionError(
                f"this worker's constructor failed; tear it down. Its error:\n{self._construct_error}")

    async def run_call(self, active: ActiveCall, payload: Any, decoded: Any = None) -> None:
        """CALL: decode and look up (unless admission did: ``decoded`` is what it gave,
        :meth:`CallAdmission.admit`), materialize refs, run (thread or loop), package, reply."""
        assert active.gates is not None  # the general path's calls have gates
        prev, mine = active.gates
        admission = self.admission
        header = active.header
        job = None
        found = None
        try:
            if type(decoded) is Declined:
                value, found = decoded.value, decoded.found
            else:
                value = (self._decode_payload(header, payload, active.stream) if decoded is None
                         else decoded)
            if type(value) is DecodeFailed:
                value.raise_error()
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                raise errors.InvalidArgumentError(
                    f"a CALL payload must decode to (args, kwargs), got {type(value).__name__}")
            args, kwargs = value
            if self.construct_state == "pending":
                await self._construct_done
            self.precondition_for_call()
            fn, is_async, materialize = found if found is not None else self.lookup(header.method)
            if materialize and (any(map(refs.is_ref, args)) or any(map(refs.is_ref, kwargs.values()))):
                args, kwargs = await self._materialize(active, args, kwargs)
            if is_async:
                admission.open_gate(prev, mine)
            else:
                if not prev.done():
                    await prev
                admission.check_start(active, f"call {header.method!r}")
                job = self.exec_thread.submit(self.invoker.invoke, fn, args, kwargs, header, active.stream.conn)
                active.job = job
                # Only the job holds the arguments now: the execution thread drops them after
                # the call, so a result computed in place can be told from a kept argument.
                value = args = kwargs = decoded = payload = None
        finally:
            admission.open_gate(prev, mine)
        if job is not None:
            assert job.future is not None  # submit() gives every job one
            outcome = await job.future
        else:
            started = now_ns() if RING.on else 0
            try:
                result = await fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - user code
                if started:
                    RING.add("run", header.method, started, now_ns(), header.trace_id, ok=False)
                if isinstance(exc, errors.PodiumError) and header.method in _HOST_CALLS:
                    raise  # the host's own error (NotFound, OutOfRange; a stream's end or item error)
                raise call_error(fn, args, kwargs, exc, self.config.rank, self.config.node_address) from None
            if started:
                RING.add("run", header.method, started, now_ns(), header.trace_id)
            value = args = kwargs = decoded = payload = None  # the arguments die before the reply
            # (The host's own async calls may answer with a packaged result: a stream's next item.)
            outcome = result if type(result) is Outcome else self.invoker.package(result, header, active.stream.conn)
        active.bytes_out = outcome.nbytes
        await active.stream.send_outcome(active.call_id, outcome)

    async def _materialize(self, active: ActiveCall, args: Any, kwargs: Any) -> tuple[list, dict]:
        """Fetch top-level ref arguments from their owners, within the call's deadline (a
        "fetch" span on the timeline: a DataProtoFuture read from another worker)."""
        method = active.header.method
        started = now_ns() if RING.on else 0
        ok = False
        try:
            if active.deadline:
                fetched = await asyncio.wait_for(refs.materialize(args, kwargs),
                                                 max(0.0, active.deadline - time.monotonic()))
            else:
                fetched = await refs.materialize(args, kwargs)
            ok = True
            return fetched
        except asyncio.TimeoutError:
            raise errors.DeadlineExceededError(
                f"fetching the arguments of {method!r} did not finish within the call's deadline") from None
        except errors.UnavailableError as exc:
            # The owner of an argument is gone, not this worker: a distinct class, so the
            # caller does not mistake it for this worker's death.
            raise errors.DataLossError(
                f"rank {self.config.rank} could not fetch an argument of {method!r} from its "
                f"owner: {exc}", details={"cause": type(exc).__name__}) from None
        finally:
            if started:
                RING.add("fetch", method, started, now_ns(), active.header.trace_id, active.call_id, ok=ok)

    # ---------------------------------------------------------------- what the unary RPCs answer

    def describe(self) -> worker_pb2.DescribeResponse:
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
        returns = self._declared_returns()
        return worker_pb2.DescribeResponse(
            method_returns={name: n for name, (n, _) in returns.items()},
            stream_buffers={name: bound for name, (_, bound) in returns.items() if bound is not None},
            worker_id=self.config.worker_id, rank=self.config.rank, world_size=self.config.world_size,
            pid=os.getpid(), class_name=self._class_name, constructed=self.construct_state == "done",
            methods=methods, node_address=self.config.node_address, hostname=self._hostname,
            shm_domain=self._shm_domain,
            call_port=self.call_port, stats=self.stats_now(), method_stats=self.methods.to_proto())

    def _declared_returns(self) -> dict[str, tuple[int, int | None]]:
        """What the hosted class's methods return other than one ref (found once it is built)."""
        if self._returns is None:
            if self._obj is None:
                return {}
            from podium.worker.caller.streaming import declared_returns

            hosted = self._obj.__dict__.get("_podium_actor", self._obj) if hasattr(self._obj, "__dict__") else self._obj
            try:
                self._returns = declared_returns(type(hosted))
            except Exception:  # noqa: BLE001 - a class whose attributes cannot be read: none declared
                self._returns = {}
        return self._returns

    def stats_now(self) -> dict:
        """The counters, with every finished call counted (a copy; see ``CallBook.stats_now``)."""
        self.exec_thread.settle()
        return self.book.stats_now()

    def fetch_value(self, object_id: str, rows: tuple[int, int] | None) -> tuple[Any, Any]:
        """(value, Encoded) of a held object or a row range of it."""
        held = self.held.get(object_id)
        if rows is None:
            return held.value, held.encoded
        value = refs.slice_rows(held.value, rows[0], rows[1])
        return value, codec.encode(value)

    async def _fetch_call(self, object_id: str, rows: tuple[int, int] | None = None) -> Any:
        """FETCH_CALL: a held result (or rows of it) for a peer, as a call's reply."""
        value, encoded = self.fetch_value(object_id, (rows[0], rows[1]) if rows is not None else None)
        self.stats["fetches_served"] += 1
        self.stats["bytes_served"] += encoded.nbytes
        return value

    async def fetch_chunks(self, request: worker_pb2.FetchRequest) -> AsyncIterator[worker_pb2.DataChunk]:
        """A held result (or a row range of it) as DataChunks, or one naming a shared-memory segment."""
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

    def request_shutdown(self, reason: str) -> None:
        """Stop the process shortly after (the Shutdown RPC answers first)."""
        log.info("shutdown requested: %s", reason or "(no reason given)")
        self._loop.call_later(0.05, self.stopping.set)

    def close(self) -> None:
        """Stop taking work; a running user call is left to finish on its own thread."""
        self.exec_thread.stop()
        self.held.clear()


def _declared_of(cls: Any, args: Any) -> dict[str, tuple[int, int | None]]:
    """``declared_returns`` of the user's class inside the wrappers an owner sends
    (``WithProcessEnv(env, cls, args, kwargs)``, ``ActorShell(cls, ...)``); {} when unknown."""
    if cls is WithProcessEnv and len(args) >= 3:
        cls, args = args[1], args[2]
    if cls is ActorShell and args:
        cls = args[0]
    try:
        return declared_returns(cls) if isinstance(cls, type) else {}
    except Exception:  # noqa: BLE001 - a class whose attributes cannot be read: none declared
        return {}
