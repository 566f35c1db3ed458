"""The one exception tree of Podium, and its mapping to gRPC status codes.

Every error a user can see is a :class:`PodiumError`. Each gRPC status code has
exactly one class; a few subclasses add fields and travel as their base code
plus an ``ErrorInfo`` (``podium.v1.ErrorInfo``, sent as the binary trailing
metadata ``podium-error-bin``) that names the exact class, so the client
rebuilds the very exception the server raised. Builtin mix-ins let callers catch
what they already know: a bad spec is also a ``ValueError``, a timeout also a
``TimeoutError``, a dead peer also a ``ConnectionError``::

    PodiumError (Exception)
    ├── CancelledError ............................ CANCELLED
    ├── RemoteError ............................... UNKNOWN         user code raised (rank, remote traceback)
    ├── InvalidArgumentError (ValueError) ......... INVALID_ARGUMENT
    │   ├── InvalidSpecError ...................... bad bundle / strategy / resource / env
    │   ├── InvalidArgumentAssertion (AssertionError)  a check verl makes with assert failed
    │   ├── ArgumentMismatchError (TypeError) ..... a call's arguments do not fit the method
    │   └── RankZeroDispatchError (KeyError) ...... Dispatch.RANK_ZERO used (use Execute.RANK_ZERO)
    ├── DeadlineExceededError (TimeoutError) ...... DEADLINE_EXCEEDED
    │   └── UnresponsiveError ..................... ranks stopped answering liveness pings (ranks)
    ├── NotFoundError (LookupError) ............... NOT_FOUND
    │   └── ObjectLostError ....................... a ref's value is gone (released, owner gone)
    │       └── OwnerDiedError .................... the process that owns the ref's value ended
    ├── AlreadyExistsError ........................ ALREADY_EXISTS
    ├── PermissionDeniedError (PermissionError) ... PERMISSION_DENIED
    ├── ResourceExhaustedError .................... RESOURCE_EXHAUSTED
    │   ├── SlotFullError ......................... a colocation slot / bundle is full
    │   └── PayloadTooLargeError .................. a payload above the configured maximum
    ├── FailedPreconditionError ................... FAILED_PRECONDITION
    │   └── InfeasibleError ....................... no registered cluster can ever hold the spec
    ├── AbortedError .............................. ABORTED
    ├── OutOfRangeError ........................... OUT_OF_RANGE
    ├── UnimplementedError (NotImplementedError) .. UNIMPLEMENTED
    │   ├── UnknownMethodError (AttributeError) ... the worker has no such method
    │   └── NotProvidedError (AttributeError) ..... a Ray name the ray stand-in does not provide
    ├── InternalError ............................. INTERNAL
    ├── UnavailableError (ConnectionError) ........ UNAVAILABLE
    │   ├── WorkerDiedError ....................... a worker process ended (exit code / signal, stderr tail)
    │   │   └── ActorUnavailableError ............. an actor died with a call in flight and restarts
    │   └── WeightBroadcastError .................. a weight update missed replicas (which, and who kept what)
    ├── DataLossError ............................. DATA_LOSS
    └── AuthenticationError (PermissionError) ..... UNAUTHENTICATED

This module imports no gRPC (the pure scheduling core may raise these);
``podium.rpc`` turns them into statuses and back.
"""

from __future__ import annotations

import json
import signal as _signal
import sys
from typing import Any, ClassVar


class PodiumError(Exception):
    """Base of every Podium error.

    ``details`` holds class-specific string fields that travel over the wire;
    ``node`` and ``rank`` say where it happened when known (rank -1: unknown).
    """

    #: Name of the gRPC status code this class travels as (see STATUS_OF).
    code: ClassVar[str] = "UNKNOWN"

    def __init__(self, message: str = "", *, node: str = "", rank: int = -1,
                 details: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.node = node
        self.rank = rank
        self.details: dict[str, str] = dict(details or {})

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        # Exceptions with keyword-only fields do not pickle by default; workers
        # and controllers pass them through the codec, so keep them whole.
        return (_rebuild, (type(self).__name__, self.message, self.node, self.rank, self.details,
                           getattr(self, "traceback", "")))


class CancelledError(PodiumError):
    """The call was cancelled before it ran (by the caller or by teardown)."""

    code = "CANCELLED"


class RemoteError(PodiumError):
    """User code in a worker raised.

    ``remote_type`` is the qualified name of the original exception, ``traceback``
    the remote traceback text and ``rank`` the rank that raised. ``str()`` shows
    all three, so an uncaught RemoteError explains itself.
    """

    code = "UNKNOWN"

    def __init__(self, message: str = "", *, traceback: str = "", remote_type: str = "",
                 node: str = "", rank: int = -1, details: dict[str, str] | None = None) -> None:
        details = dict(details or {})
        if remote_type:
            details["remote_type"] = remote_type
        super().__init__(message, node=node, rank=rank, details=details)
        self.traceback = traceback

    @property
    def remote_type(self) -> str:
        """Qualified name of the exception raised in the worker."""
        return self.details.get("remote_type", "")

    def __str__(self) -> str:
        where = f"rank {self.rank}" if self.rank >= 0 else "a worker"
        if self.node:
            where += f" on {self.node}"
        head = f"{self.remote_type or 'Exception'} in {where}: {self.message}"
        return f"{head}\n\nRemote traceback:\n{self.traceback}" if self.traceback else head


class InvalidArgumentError(PodiumError, ValueError):
    """A request or argument is malformed; nothing was changed."""

    code = "INVALID_ARGUMENT"


class InvalidSpecError(InvalidArgumentError):
    """A resource spec is invalid (empty bundles, negative or NaN amounts, unknown
    resource or strategy, a GPU fraction outside (0, 1], a protected env name)."""


class InvalidArgumentAssertion(InvalidArgumentError, AssertionError):
    """An argument failed a check that verl makes with ``assert`` (a DataProto that does not
    split evenly, batch sizes that differ, conflicting ``meta_info``): also an
    ``AssertionError``, so verl code that catches one still does."""


class ArgumentMismatchError(InvalidArgumentError, TypeError):
    """A call's arguments do not match the method's signature (wrong count or name);
    a TypeError too, as Ray raises at ``.remote()``. The method did not run."""


class RankZeroDispatchError(InvalidArgumentError, KeyError):
    """``Dispatch.RANK_ZERO`` was used; it has no dispatch function (use ``Execute.RANK_ZERO``).

    Also a ``KeyError``, so code written against verl's behaviour (a bare ``KeyError`` when the
    worker group is built) still catches it.
    """

    def __str__(self) -> str:  # KeyError.__str__ would repr() the message
        return self.message


class DeadlineExceededError(PodiumError, TimeoutError):
    """A wait ran out of time; the message says what it was still waiting for."""

    code = "DEADLINE_EXCEEDED"


class UnresponsiveError(DeadlineExceededError):
    """Ranks stopped answering liveness pings while calls on them were pending (a stopped,
    deadlocked or frozen process); ``ranks`` lists them, the message says where and how long,
    and ``stacks`` holds the last stacks (or /proc state) of each that could be had."""

    @property
    def ranks(self) -> list[int]:
        """The silent ranks, in rank order."""
        return [int(r) for r in self.details.get("ranks", "").split(",") if r]

    @property
    def stacks(self) -> dict[int, str]:
        """rank -> what could be had of its stacks when it was found silent: the worker's
        threads, or (a stopped rank cannot answer) its /proc state and why there are none."""
        prefix = "stacks."
        return {int(k[len(prefix):]): v for k, v in self.details.items()
                if k.startswith(prefix) and k[len(prefix):].lstrip("-").isdigit()}


class NotFoundError(PodiumError, LookupError):
    """An id or name is unknown."""

    code = "NOT_FOUND"


class ObjectLostError(NotFoundError):
    """A ref's value cannot be fetched: its owner (the process that holds it) is gone, or
    released it. The message names the owner; ``details`` has ``object_id``, ``owner_address``
    and ``worker_id``."""


class OwnerDiedError(ObjectLostError):
    """A ref's value cannot be fetched because its owner, the process that created it and
    holds it, has ended (Ray's ``OwnerDiedError``)."""


class AlreadyExistsError(PodiumError):
    """A name is already taken."""

    code = "ALREADY_EXISTS"


class PermissionDeniedError(PodiumError, PermissionError):
    """The caller is known but not allowed to do this."""

    code = "PERMISSION_DENIED"


class ResourceExhaustedError(PodiumError):
    """A limit was reached right now (a full slot, a memory budget, a payload size)."""

    code = "RESOURCE_EXHAUSTED"


class SlotFullError(ResourceExhaustedError):
    """A worker slot asked for more of its bundle than is free (a full colocation slot)."""


class PayloadTooLargeError(ResourceExhaustedError):
    """A payload is larger than the configured maximum."""


class FailedPreconditionError(PodiumError):
    """The system is not in a state where this can be done."""

    code = "FAILED_PRECONDITION"


class InfeasibleError(FailedPreconditionError):
    """No set of registered nodes can ever hold the spec.

    ``node_reasons`` maps each node id to why it cannot help, e.g.
    ``{"node-b": "4 GPUs, bundle group needs 8 on one node (STRICT_PACK)"}``.
    """

    def __init__(self, message: str = "", *, node_reasons: dict[str, str] | None = None,
                 node: str = "", rank: int = -1, details: dict[str, str] | None = None) -> None:
        details = dict(details or {})
        if node_reasons is not None:
            details["node_reasons"] = json.dumps(node_reasons, sort_keys=True)
        super().__init__(message, node=node, rank=rank, details=details)

    @property
    def node_reasons(self) -> dict[str, str]:
        """Why each node cannot hold the spec."""
        return json.loads(self.details.get("node_reasons", "{}"))

    def __str__(self) -> str:
        reasons = self.node_reasons
        if not reasons:
            return self.message
        lines = "\n".join(f"  {node}: {why}" for node, why in sorted(reasons.items()))
        return f"{self.message}\n{lines}"


class AbortedError(PodiumError):
    """The operation was aborted by a conflict."""

    code = "ABORTED"


class OutOfRangeError(PodiumError):
    """A value is outside its valid range (e.g. a row range past the end)."""

    code = "OUT_OF_RANGE"


class UnimplementedError(PodiumError, NotImplementedError):
    """The operation is not supported."""

    code = "UNIMPLEMENTED"


class UnknownMethodError(UnimplementedError, AttributeError):
    """The hosted object has no method of that name."""


class NotProvidedError(UnimplementedError, AttributeError):
    """A name of Ray's API that Podium's ``ray`` stand-in does not provide; an
    ``AttributeError`` too, so ``hasattr`` and ``getattr(ray, name, default)`` answer as
    they do for any missing attribute."""


class InternalError(PodiumError):
    """A bug in Podium: the message says where."""

    code = "INTERNAL"


class UnavailableError(PodiumError, ConnectionError):
    """A peer (scheduler, node agent, worker) cannot be reached."""

    code = "UNAVAILABLE"


class WorkerDiedError(UnavailableError):
    """A worker process ended while a call needed it.

    Fields: ``rank``, ``node``, ``exit_code`` (or None), ``signal`` (or None) and
    ``stderr_tail`` (its last lines of stderr).
    """

    def __init__(self, message: str = "", *, exit_code: int | None = None,
                 signal: int | None = None, stderr_tail: str = "", node: str = "",
                 rank: int = -1, details: dict[str, str] | None = None) -> None:
        details = dict(details or {})
        if exit_code is not None:
            details["exit_code"] = str(exit_code)
        if signal:
            details["signal"] = str(signal)
        if stderr_tail:
            details["stderr_tail"] = stderr_tail
        super().__init__(message, node=node, rank=rank, details=details)

    @property
    def exit_code(self) -> int | None:
        """Exit status, or None when it was killed by a signal or is unknown."""
        value = self.details.get("exit_code")
        return int(value) if value is not None else None

    @property
    def signal(self) -> int | None:
        """Number of the signal that killed it, or None."""
        value = self.details.get("signal")
        return int(value) if value is not None else None

    @property
    def stderr_tail(self) -> str:
        """The last lines the worker wrote to stderr."""
        return self.details.get("stderr_tail", "")

    def __str__(self) -> str:
        text = self.message
        if self.signal:
            try:
                name = _signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            text += f" (killed by {name})"
        elif self.exit_code is not None:
            text += f" (exit code {self.exit_code})"
        if self.stderr_tail:
            text += "\nLast lines of its stderr:\n" + self.stderr_tail
        return text


class ActorUnavailableError(WorkerDiedError):
    """An actor's process died while a call was in flight and the actor is being restarted
    (``max_restarts``): the call may or may not have run, and it is not sent again
    (``max_task_retries`` is 0, or its retries are used up). Ray's ``ActorUnavailableError``;
    a WorkerDiedError too (Ray's is a ``RayActorError``)."""


class WeightBroadcastError(UnavailableError):
    """A weight update did not reach every replica.

    Fields: ``failed`` (replica name -> why), ``updated`` (replicas holding the new
    weights) and ``kept`` (replicas that kept their previous weights, whole).
    """

    def __init__(self, message: str = "", *, failed: dict[str, str] | None = None,
                 updated: list[str] | None = None, kept: list[str] | None = None) -> None:
        super().__init__(message, details={"failed": json.dumps(failed or {}),
                                           "updated": json.dumps(updated or []),
                                           "kept": json.dumps(kept or [])})

    def _field(self, key: str, empty: Any) -> Any:
        return json.loads(self.details.get(key) or json.dumps(empty))

    @property
    def failed(self) -> dict[str, str]:
        """Each replica that failed, and why."""
        return self._field("failed", {})

    @property
    def updated(self) -> list[str]:
        """The replicas that hold the new weights."""
        return self._field("updated", [])

    @property
    def kept(self) -> list[str]:
        """The replicas that kept their previous weights."""
        return self._field("kept", [])


class DataLossError(PodiumError):
    """Data was lost or corrupted in transit (a truncated payload)."""

    code = "DATA_LOSS"


class AuthenticationError(PodiumError, PermissionError):
    """The cluster token is missing or wrong."""

    code = "UNAUTHENTICATED"


#: The one table: gRPC status code name -> the class that travels as it.
#: Subclasses travel as their base's code plus ErrorInfo.type.
CLASS_OF_STATUS: dict[str, type[PodiumError]] = {
    cls.code: cls
    for cls in (CancelledError, RemoteError, InvalidArgumentError, DeadlineExceededError,
                NotFoundError, AlreadyExistsError, PermissionDeniedError,
                ResourceExhaustedError, FailedPreconditionError, AbortedError,
                OutOfRangeError, UnimplementedError, InternalError, UnavailableError,
                DataLossError, AuthenticationError)
}

#: Every class by name, for rebuilding the exact class from ErrorInfo.type.
CLASS_BY_NAME: dict[str, type[PodiumError]] = {}


def _collect(cls: type[PodiumError]) -> None:
    CLASS_BY_NAME[cls.__name__] = cls
    for sub in cls.__subclasses__():
        _collect(sub)


_collect(PodiumError)


def status_name_of(exc: BaseException) -> str:
    """The gRPC status code name an exception travels as (UNKNOWN for non-Podium errors)."""
    return exc.code if isinstance(exc, PodiumError) else "UNKNOWN"


def error_fields(exc: BaseException) -> dict[str, Any]:
    """The wire fields of an exception, as a dict shaped like ``podium.v1.ErrorInfo``."""
    if isinstance(exc, PodiumError):
        return {"type": type(exc).__name__, "message": exc.message,
                "traceback": getattr(exc, "traceback", ""), "rank": exc.rank,
                "node": exc.node, "details": dict(exc.details)}
    return {"type": "RemoteError", "message": str(exc), "traceback": "", "rank": -1,
            "node": "", "details": {"remote_type": f"{type(exc).__module__}.{type(exc).__qualname__}"}}


def error_from_fields(type_name: str, message: str, *, traceback: str = "", rank: int = -1,
                      node: str = "", details: dict[str, str] | None = None,
                      status_name: str = "UNKNOWN") -> PodiumError:
    """Rebuild the exception named ``type_name``; falls back to the class of ``status_name``."""
    cls = CLASS_BY_NAME.get(type_name) or CLASS_OF_STATUS.get(status_name, PodiumError)
    if cls is RemoteError and details:
        cls = remote_error_class(details.get("remote_type", ""))
    exc = cls.__new__(cls)
    PodiumError.__init__(exc, message, node=node, rank=rank, details=details)
    if traceback or cls is RemoteError or issubclass(cls, RemoteError):
        exc.traceback = traceback  # type: ignore[attr-defined]  # RemoteError's field
    return exc


#: RemoteError classes that are also their remote type, by that type (bounded: see below).
_DUAL: dict[type, type] = {}
_MAX_DUAL = 256


def remote_error_class(remote_type: str) -> type:
    """RemoteError, or a subclass of it that is also the raised type (as Ray's
    ``RayTaskError(ValueError)``), so ``except ValueError`` catches a ValueError raised in a
    worker. Only a class this process has already imported is used (a name from the wire never
    imports a module); BaseExceptions that are not Exceptions, the end-of-iteration ones and
    Podium's own stay plain RemoteErrors."""
    module, _, qualname = remote_type.rpartition(".")
    cause: Any = sys.modules.get(module or "builtins")  # a builtin travels unqualified
    for part in qualname.split(".") if cause is not None and qualname else ():
        cause = getattr(cause, part, None)
    if (not isinstance(cause, type) or not issubclass(cause, Exception) or issubclass(cause, PodiumError)
            or issubclass(cause, (StopIteration, StopAsyncIteration))):
        return RemoteError
    dual = _DUAL.get(cause)
    if dual is None:
        try:
            dual = type("RemoteError", (RemoteError, cause), {"__qualname__": f"RemoteError({cause.__qualname__})",
                                                              "__module__": __name__})
        except TypeError:  # a layout no subclass can share
            return RemoteError
        if len(_DUAL) < _MAX_DUAL:
            _DUAL[cause] = dual
    return dual


def _rebuild(type_name: str, message: str, node: str, rank: int, details: dict[str, str],
             traceback: str) -> PodiumError:
    return error_from_fields(type_name, message, traceback=traceback, rank=rank, node=node,
                             details=details)
