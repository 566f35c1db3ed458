"""What a call's result becomes in the worker: a packaged :class:`Outcome` (a held ref, a
shared-memory segment, or bytes to stream), a :class:`FrozenResult` snapshot for held
results, and the errors user code is reported as."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import threading
import traceback
from typing import Any, Callable

from podium import codec, errors
from podium.memorypool import MIN_POOLED_BYTES, POOL, copy_segments
from podium.v1 import worker_pb2
from podium.worker.host import gpucap

__all__ = ["Outcome", "LentReply", "FrozenResult", "ENCODED_NONE", "NONE_OUTCOME", "NONE_REPLY_TAIL",
           "IMMUTABLE_RESULTS", "remote_error", "call_error", "close_names"]

log = logging.getLogger("podium.worker.host")

#: A reply sent from the method's own memory (:class:`LentReply`) must have left within this
#: many seconds, plus one per :data:`LENT_BYTES_PER_SECOND` bytes, or its connection is closed.
LENT_SECONDS = 60.0
LENT_BYTES_PER_SECOND = 10e6
# After closing such a connection, how long the loop gets to let go of the memory.
_LENT_ABORT_SECONDS = 10.0


@dataclasses.dataclass
class Outcome:
    """A packaged result: a held ref, a shared-memory segment, or bytes to stream."""

    ref: worker_pb2.ObjectRefInfo | None = None
    shm_name: str = ""
    #: shm_name is a segment of the stream's pool (podium.transport.shmpool), not a one-shot one.
    shm_pooled: bool = False
    segments: list = dataclasses.field(default_factory=list)
    nbytes: int = 0
    #: Buffers left in the caller's segment ``refs_segment``: flat (index, offset, length).
    refs_segment: str = ""
    refs: list[int] = dataclasses.field(default_factory=list)
    #: Not final yet: ``pending()`` makes the final Outcome (see :meth:`settle`).
    pending: Any = None
    #: ``segments`` view the method's own memory, not a copy (see :class:`LentReply`).
    lent: LentReply | None = None

    def settle(self) -> Outcome:
        """The final form of this outcome. A result computed in place in its call's argument
        segment is packaged on the execution thread only once the call's arguments are
        dropped (``ExecutionThread``), since only then can it tell whether the method kept a
        view of them (see ``SyncInvoker.package``)."""
        return self if self.pending is None else self.pending()

    def header(self) -> worker_pb2.ReplyHeader:
        """The success header of a reply carrying this outcome (not a ref)."""
        return worker_pb2.ReplyHeader(ok=True, payload_size=self.nbytes, shm_name=self.shm_name,
                                      shm_pooled=self.shm_pooled, refs_segment=self.refs_segment,
                                      refs=self.refs)

    def reply_tail(self) -> bytes:
        """The serialized one-frame reply of a small outcome that carries its bytes, or of a
        held result's ref, without its call id (:func:`podium.transport.frames.frame_with_call_id`
        adds it)."""
        if self is NONE_OUTCOME:
            return NONE_REPLY_TAIL
        if self.ref is not None:
            return worker_pb2.ReplyFrame(header=worker_pb2.ReplyHeader(ok=True, ref=self.ref),
                                         last=True).SerializeToString()
        return worker_pb2.ReplyFrame(header=self.header(), data=b"".join(self.segments),
                                     last=True).SerializeToString()


def reply_snapshot(segments: list, nbytes: int) -> list[memoryview]:
    """A result's wire form copied into one buffer, on the thread that made the result.

    The raw call socket sends a reply from the memory it is given, as the socket takes it
    (the event loop does not copy), so a reply that viewed the method's tensors would pick
    up what the next call writes into them meanwhile. A copy here makes every reply a
    snapshot of the value at return, as Ray's object store and this host's shared-memory
    replies are. Large ones go into the process's pool of reused mappings. (A large reply
    made on the execution thread is lent instead: :class:`LentReply`.)
    """
    if nbytes < MIN_POOLED_BYTES:
        buffer = bytearray(nbytes)
        copy_segments(buffer, segments)
        return [memoryview(buffer)]
    mapping = POOL.take(nbytes)
    copy_segments(mapping, segments)
    return [POOL.lease(mapping, nbytes)]


class LentReply:
    """A large reply sent over TCP straight from the method's own tensors, without the
    snapshot copy (:func:`reply_snapshot`): the copy cost ~20 ms per 128 MiB, about a third
    of the transfer.

    The reply is still the value at return: the execution thread, the only thread that runs
    the object's methods, starts nothing else until the socket has taken those bytes
    (:meth:`wait`; the loop calls :meth:`release` then, or when the connection ends). A peer
    that stops reading has its connection closed after a deadline that grows with the size.
    """

    __slots__ = ("_sent", "_abort", "nbytes")

    def __init__(self, nbytes: int, abort: Callable[[BaseException], None]) -> None:
        self._sent = threading.Event()
        self._abort = abort
        self.nbytes = nbytes

    def release(self) -> None:
        """The memory is not read any more (any thread; idempotent)."""
        self._sent.set()

    def wait(self) -> None:
        """Block until :meth:`release` (execution thread); past the deadline, close the connection."""
        deadline = LENT_SECONDS + self.nbytes / LENT_BYTES_PER_SECOND
        if self._sent.wait(deadline):
            return
        log.warning("a reply of %d bytes was not taken by its peer within %.0f s: closing the connection",
                    self.nbytes, deadline)
        self._abort(errors.DeadlineExceededError(
            f"the peer did not read a reply of {self.nbytes} bytes within {deadline:.0f} s"))
        if not self._sent.wait(_LENT_ABORT_SECONDS):
            log.error("a closed connection still holds a lent reply after %.0f s; going on", _LENT_ABORT_SECONDS)


class FrozenResult:
    """A held result's wire form, copied once into one buffer.

    The copy makes a held result a snapshot, as Ray's object store does: user
    code that mutates a returned tensor afterwards cannot change what peers
    fetch. Quacks like :class:`podium.codec.Encoded` (``nbytes``, ``to_segments``).

    A large one is copied into a mapping of :data:`podium.memorypool.POOL`, which goes back
    to the pool when the held value (decoded zero-copy from it) and this copy are released:
    a loop that holds a result of the same size every step reuses the pages, where a fresh
    buffer would pay the kernel for zeroed pages each time (several times the copy).
    """

    __slots__ = ("buffer",)

    def __init__(self, segments: list, nbytes: int) -> None:
        self.buffer: Any = POOL.lease(POOL.take(nbytes), nbytes) if nbytes >= MIN_POOLED_BYTES else bytearray(nbytes)
        copy_segments(self.buffer, segments)

    @property
    def nbytes(self) -> int:
        """Size of the wire form."""
        return len(self.buffer)

    def to_segments(self) -> list[memoryview]:
        """The wire form as one segment."""
        return [memoryview(self.buffer)]


#: The wire form of None, made once (its segments are immutable bytes).
ENCODED_NONE = codec.encode(None)
#: The outcome of returning None (what most methods do), made once and never changed: a
#: method that returns None costs no packaging, and its reply is serialized once.
NONE_OUTCOME = Outcome(segments=ENCODED_NONE.to_segments(), nbytes=ENCODED_NONE.nbytes)
#: NONE_OUTCOME's one-frame reply without its call id (serialized once).
NONE_REPLY_TAIL = worker_pb2.ReplyFrame(header=NONE_OUTCOME.header(), data=b"".join(NONE_OUTCOME.segments),
                                        last=True).SerializeToString()
#: Results that cannot change after they are returned: a held one needs no decoded copy.
IMMUTABLE_RESULTS = frozenset({type(None), bool, int, float, complex, str, bytes})


def remote_error(exc: BaseException, rank: int, node: str, skip_frames: int = 1) -> errors.RemoteError:
    """The RemoteError a user exception travels as, its traceback starting in user code."""
    # Drop the host's own frames so the traceback starts in user code.
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(exc, errors.RemoteError) and exc.remote_type:
        # Another worker's failure this code let through (a nested ray.get) travels as its cause,
        # as Ray's RayTaskError does ("avoid recursive nesting"): the first raiser's type and
        # message; the traceback is this process's frames, then the first one's, once.
        return errors.RemoteError(exc.message, traceback=text, remote_type=exc.remote_type, rank=rank, node=node)
    # A CUDA OOM under a Podium memory cap names the cap (not just torch's numbers).
    message = gpucap.oom_message(exc) or str(exc)
    return errors.RemoteError(message, traceback=text, remote_type=name, rank=rank, node=node)


def call_error(fn: Any, args: Any, kwargs: Any, exc: BaseException, rank: int, node: str
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
    return remote_error(exc, rank, node)


def close_names(name: str, obj: Any) -> list[str]:
    """Method names of ``obj`` close to ``name`` (for "did you mean" hints)."""
    candidates = [n for n in dir(obj) if not n.startswith("__")]
    return difflib.get_close_matches(name, candidates, n=5, cutoff=0.5)
