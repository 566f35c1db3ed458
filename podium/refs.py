"""References to results held in worker processes: :class:`ObjectRef` and
:class:`DataProtoFuture`, and the process-wide resolver that fetches them.

A call made with ``hold_result`` leaves its result in the worker that produced
it and answers with an :class:`ObjectRef` (owner address, id, size, rows). Refs
are small and picklable, so they travel inside the arguments of later calls; a
worker that receives one fetches the value (or only the rows it needs) straight
from the owner, so the bytes never pass through the controller.

Fetching goes through one resolver per process (:func:`set_resolver`): the
worker host installs a pool of worker clients keyed by owner address, the
controller SDK installs its own. A resolver provides::

    async def fetch(ref: ObjectRef, rows: tuple[int, int] | None = None) -> Any
    def run_sync(coro, timeout: float | None) -> Any   # from a non-loop thread

This module imports no gRPC, torch or tensordict at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import sys
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from podium import codec
from podium.borrows import BORROWS
from podium.errors import (ArgumentMismatchError, FailedPreconditionError, InvalidArgumentError, NotFoundError,
                           ObjectLostError, OutOfRangeError, OwnerDiedError, UnavailableError)

__all__ = ["ObjectRef", "BorrowedRef", "DataProtoFuture", "Resolver", "set_resolver", "get_resolver", "on_loop",
           "exporting", "keep_if_exported", "own",
           "materialize", "is_ref", "concat_values", "rows_of", "slice_rows", "inline_value", "lost_error"]


#: While a worker encodes what leaves it for good (a result, a held value): the list that
#: keeps the refs found inside it.
_exporting: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("podium_exporting", default=None)
#: Refs this process owns or borrows that left it inside a result: kept until the process
#: ends. A result may be fetched (and so borrowed) long after the method returned, or never,
#: so nothing tells when its receivers are done; the hold budget bounds what this keeps.
_exported: list[Any] = []
#: The refs of values this process holds for ``put``, by object id, while one lives: a ref
#: to one of them unpickled here (from a value fetched back) is that same ref, so it keeps
#: the value alive as the first one does (:func:`own`).
_owned: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


@contextlib.contextmanager
def exporting(kept: list[Any] | None = None):
    """Mark the encoding of a value that leaves this process: the refs inside it are kept in
    ``kept`` (a ``put`` value's, for as long as that value is held) or, by default, until the
    process ends (a result's). Nested, the outer list wins."""
    outer = _exporting.get()
    token = _exporting.set(outer if outer is not None else _exported if kept is None else kept)
    try:
        yield
    finally:
        _exporting.reset(token)


def keep_if_exported(ref: Any) -> None:
    """Called as a ref this process owns or borrows is pickled: inside a value that leaves
    this process (:func:`exporting`), keep it (and so its value) alive as long as needed."""
    kept = _exporting.get()
    if kept is not None:
        kept.append(ref)


def own(ref: Any) -> None:
    """Register the ref of a value this process holds (see :data:`_owned`)."""
    _owned[ref.object_id] = ref


async def on_loop(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    """Await ``coro`` on ``loop``: here when this is that loop, else there, waiting here
    without blocking this loop (a ref awaited in the driver's own loop, or in an async actor,
    is fetched by the loop that owns the clients)."""
    if asyncio.get_running_loop() is loop:
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectRef:
    """A result held in a worker: enough to fetch it from its owner directly."""

    #: Id unique in the owner worker ("o-...").
    object_id: str
    #: Scheduler id of the owner worker.
    worker_id: str
    #: "host:port" of the owner's gRPC server.
    owner_address: str
    #: Rank of the owner in its group.
    owner_rank: int
    #: Encoded size in bytes.
    size_bytes: int
    #: Rows when the value is a DataProto or TensorDict, else -1.
    rows: int = -1
    #: The encoded value when the owner sent it along with the ref (small results), so the
    #: process that made the call resolves it without a Fetch. Not pickled: a ref passed
    #: on to another process is fetched from its owner as before.
    inline: bytes | None = dataclasses.field(default=None, compare=False, repr=False)

    def __reduce__(self):
        return (_received, (self.object_id, self.worker_id, self.owner_address, self.owner_rank,
                            self.size_bytes, self.rows))

    async def aget(self, timeout: float | None = None) -> Any:
        """Fetch the whole value from its owner (async, on any event loop)."""
        coro = get_resolver().fetch(self)
        return await (asyncio.wait_for(coro, timeout) if timeout is not None else coro)

    def __await__(self):
        """``await ref``: the value, as ``ray``'s refs are awaited."""
        return self.aget().__await__()

    def get(self, timeout: float | None = None) -> Any:
        """Fetch the whole value from its owner (blocking; not on the resolver's loop)."""
        return get_resolver().run_sync(get_resolver().fetch(self), timeout)


class BorrowedRef(ObjectRef):
    """An ObjectRef whose value another process owns, received here: while a copy of it lives,
    its owner counts this process as a borrower and keeps the value (:mod:`podium.borrows`).
    Pickled into a worker's result it is kept, with its borrow, until this process ends
    (:func:`keep_if_exported`)."""

    def __reduce__(self):
        keep_if_exported(self)
        return super().__reduce__()


def _received(object_id: str, worker_id: str, owner_address: str, owner_rank: int, size_bytes: int,
              rows: int) -> ObjectRef:
    """A ref unpickled here: borrowed when another process owns its value and this one has a
    resolver that counts borrows, else a plain ObjectRef."""
    resolver = _resolver
    owns = getattr(resolver, "owns", None)
    if owns is None or owns(owner_address):
        mine = _owned.get(object_id)  # (a value put here, its ref unpickled here: the same ref)
        return mine if mine is not None else ObjectRef(object_id, worker_id, owner_address, owner_rank, size_bytes, rows)
    ref = BorrowedRef(object_id, worker_id, owner_address, owner_rank, size_bytes, rows)
    BORROWS.add(owner_address, object_id, resolver)
    weakref.finalize(ref, BORROWS.drop, owner_address, object_id, resolver).atexit = False
    return ref


def inline_value(ref: ObjectRef, rows: tuple[int, int] | None = None) -> Any:
    """The value (or rows of it) of a ref that carries it inline: a fresh copy each time,
    as a fetch gives. Only for refs whose ``inline`` is set."""
    assert ref.inline is not None, "inline_value needs a ref that carries its value"
    value = codec.decode(bytearray(ref.inline))  # (writable: a tensor in it is the caller's to change)
    return value if rows is None else slice_rows(value, int(rows[0]), int(rows[1]))


def lost_error(ref: ObjectRef, exc: BaseException) -> BaseException:
    """The error a failed fetch of ``ref`` should raise: :class:`ObjectLostError` naming the
    owner when the owner is unreachable or no longer holds the value, else ``exc``."""
    if isinstance(exc, ObjectLostError) or not isinstance(exc, (UnavailableError, NotFoundError)):
        return exc
    owner = ref.worker_id or "?"
    gone = not isinstance(exc, NotFoundError)
    why = ("cannot be reached (the owner process is gone)" if gone
           else "no longer holds it (released, or the owner restarted)")
    return (OwnerDiedError if gone else ObjectLostError)(
        f"object {ref.object_id} is lost: its owner {owner} at {ref.owner_address} (rank "
        f"{ref.owner_rank}) {why}: {exc}",
        details={"object_id": ref.object_id, "owner_address": ref.owner_address, "worker_id": owner})


class DataProtoFuture:
    """Rows ``[start, stop)`` of the concatenation of held DataProto/TensorDict values.

    verl's name for "a batch that is not here yet". Unlike verl's (where every
    consumer fetches every producer output), :meth:`get` fetches only the rows
    this future covers, from each overlapping owner directly.
    """

    __slots__ = ("refs", "start", "stop")

    def __init__(self, refs: Sequence[ObjectRef], start: int = 0, stop: int | None = None) -> None:
        refs = tuple(refs)
        if not refs:
            raise InvalidArgumentError("a DataProtoFuture needs at least one ObjectRef")
        for ref in refs:
            if not isinstance(ref, ObjectRef):
                raise ArgumentMismatchError(f"DataProtoFuture takes ObjectRefs, got {type(ref).__name__}")
        known = all(ref.rows >= 0 for ref in refs)
        total = sum(ref.rows for ref in refs) if known else None
        if stop is None:
            stop = total if total is not None else -1
        if (start, stop) != (0, -1):
            if total is None:
                raise InvalidArgumentError("a row range needs refs whose row counts are known "
                                 f"(rows: {[ref.rows for ref in refs]})")
            if not 0 <= start <= stop <= total:
                raise InvalidArgumentError(f"row range [{start}, {stop}) is outside the {total} rows of the refs")
        self.refs = refs
        self.start = start
        self.stop = stop

    # verl's attribute name for the refs
    @property
    def futures(self) -> list[ObjectRef]:
        """The refs this future reads from (verl's name)."""
        return list(self.refs)

    @classmethod
    def concat(cls, refs: Sequence[ObjectRef]) -> "DataProtoFuture":
        """A future over the concatenation of ``refs`` (like verl's DataProtoFuture.concat)."""
        return cls(refs)

    @property
    def rows_known(self) -> bool:
        """Whether the row count is known without fetching."""
        return self.stop >= 0

    def __len__(self) -> int:
        if not self.rows_known:
            raise ArgumentMismatchError("the length of this DataProtoFuture is unknown (its refs do not "
                            "report row counts)")
        return self.stop - self.start

    def slice(self, start: int, stop: int) -> "DataProtoFuture":
        """Rows ``[start, stop)`` of this future, still unfetched."""
        n = len(self)
        if not 0 <= start <= stop <= n:
            raise InvalidArgumentError(f"row range [{start}, {stop}) is outside the {n} rows of this future")
        return DataProtoFuture(self.refs, self.start + start, self.start + stop)

    def chunk(self, chunks: int) -> list["DataProtoFuture"]:
        """Split into ``chunks`` equal row ranges (``chunks`` must divide the rows)."""
        n = len(self)
        if chunks <= 0 or n % chunks:
            raise InvalidArgumentError(f"cannot split a DataProtoFuture of {n} rows into {chunks} equal "
                             f"chunks: {chunks} must divide {n}")
        size = n // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def parts(self) -> list[tuple[ObjectRef, tuple[int, int] | None]]:
        """(ref, local row range or None for the whole value) for each ref this future overlaps."""
        if not self.rows_known:
            return [(ref, None) for ref in self.refs]
        out = []
        offset = 0
        for ref in self.refs:
            lo, hi = max(self.start, offset), min(self.stop, offset + ref.rows)
            if lo < hi:
                whole = lo == offset and hi == offset + ref.rows
                out.append((ref, None if whole else (lo - offset, hi - offset)))
            offset += ref.rows
        if not out:  # an empty range: fetch zero rows of the first ref to keep the type
            out.append((self.refs[0], (0, 0)))
        return out

    async def aget(self, timeout: float | None = None) -> Any:
        """Fetch the covered rows from their owners and concatenate them (async)."""
        coro = self._fetch()
        return await (asyncio.wait_for(coro, timeout) if timeout is not None else coro)

    def get(self, timeout: float | None = None) -> Any:
        """Fetch the covered rows and concatenate them (blocking; not on the resolver's loop)."""
        return get_resolver().run_sync(self._fetch(), timeout)

    async def _fetch(self) -> Any:
        resolver = get_resolver()
        parts = self.parts()
        values = await asyncio.gather(*(resolver.fetch(ref, rows) for ref, rows in parts))
        return concat_values(list(values))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, DataProtoFuture) and self.refs == other.refs
                and self.start == other.start and self.stop == other.stop)

    def __hash__(self) -> int:
        return hash((self.refs, self.start, self.stop))

    def __repr__(self) -> str:
        owners = sorted({ref.owner_rank for ref in self.refs})
        return (f"DataProtoFuture(rows [{self.start}, {self.stop}) of {len(self.refs)} refs "
                f"on ranks {owners})")

    def __getstate__(self):
        return (self.refs, self.start, self.stop)

    def __setstate__(self, state) -> None:
        self.refs, self.start, self.stop = state


def concat_values(values: list[Any]) -> Any:
    """Concatenate DataProtos (``type(v).concat``) or TensorDicts (``torch.cat``) along rows."""
    if len(values) == 1:
        return values[0]
    first = values[0]
    concat = getattr(type(first), "concat", None)
    if concat is not None:
        return concat(values)
    tensordict = sys.modules.get("tensordict")
    if tensordict is not None and isinstance(first, tensordict.TensorDict):
        import torch

        return torch.cat(values, dim=0)
    raise ArgumentMismatchError(f"cannot concatenate values of type {type(first).__name__} "
                    "(a DataProtoFuture covers DataProto or TensorDict values)")


def rows_of(value: Any) -> int:
    """Rows of a DataProto or TensorDict (the first batch dimension), else -1."""
    tensordict = sys.modules.get("tensordict")
    if tensordict is not None and isinstance(value, tensordict.TensorDictBase):
        return int(value.batch_size[0]) if len(value.batch_size) else -1
    if type(value).__name__ == "DataProto" and hasattr(value, "__len__"):
        return len(value)
    return -1


def slice_rows(value: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of a held DataProto or TensorDict (OutOfRangeError when invalid)."""
    rows = rows_of(value)
    if rows < 0:
        raise OutOfRangeError(f"a row range needs a DataProto or TensorDict, the value is a "
                              f"{type(value).__name__}")
    if not 0 <= start <= stop <= rows:
        raise OutOfRangeError(f"row range [{start}, {stop}) is outside [0, {rows})",
                              details={"rows": str(rows)})
    return value[start:stop]


class Resolver(Protocol):
    """What fetches refs in this process (see the module docstring)."""

    async def fetch(self, ref: ObjectRef, rows: tuple[int, int] | None = None) -> Any:
        """The value of ``ref``, or only rows ``[rows[0], rows[1])`` of it (awaited on any
        event loop: the resolver runs it on its own, :func:`on_loop`)."""

    def run_sync(self, coro, timeout: float | None) -> Any:
        """Run ``coro`` to completion from a thread that is not the resolver's loop."""

    # A resolver that also has ``loop``, ``owns(address) -> bool`` (a value this process
    # holds) and ``async send_borrows(owner, borrow, unborrow)`` counts the refs this process
    # receives as borrows at their owners (podium.borrows).


_resolver: Resolver | None = None


def set_resolver(resolver: Resolver | None) -> Resolver | None:
    """Install the process-wide resolver; returns the previous one."""
    global _resolver
    previous, _resolver = _resolver, resolver
    return previous


def get_resolver() -> Resolver:
    """The installed resolver (FailedPreconditionError when none is)."""
    if _resolver is None:
        raise FailedPreconditionError(
            "no ref resolver in this process: refs are fetched inside a worker or through "
            "podium.controller (call init() first)")
    return _resolver


def is_ref(value: Any) -> bool:
    """Whether ``value`` is an ObjectRef or a DataProtoFuture."""
    return isinstance(value, (ObjectRef, DataProtoFuture))


async def _resolve(value: Any) -> Any:
    if isinstance(value, ObjectRef):
        return await get_resolver().fetch(value)
    return await value.aget()


async def materialize(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Replace top-level ObjectRef / DataProtoFuture arguments by their values.

    Nested refs are left alone (as in verl). Fetches run concurrently.
    """
    args = list(args)
    kwargs = dict(kwargs)
    slots: list[tuple[Any, Any]] = []
    for i, value in enumerate(args):
        if is_ref(value):
            slots.append((args, i))
    for key, value in kwargs.items():
        if is_ref(value):
            slots.append((kwargs, key))
    if slots:
        values = await asyncio.gather(*(_resolve(container[key]) for container, key in slots))
        for (container, key), value in zip(slots, values):
            container[key] = value
    return args, kwargs
