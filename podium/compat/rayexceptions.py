"""Every class of Ray 2.60's ``ray.exceptions``, as real classes in Ray's hierarchy, for the
``ray`` stand-in.

Where Podium raises the equivalent error the Ray name *is* Podium's class, so ``except
ray.exceptions.ActorDiedError`` catches a :class:`~podium.errors.WorkerDiedError` (Python's
``except`` matches by real inheritance only; a metaclass hook would not be consulted):

========================  ===========================================
Ray name                  Podium class
========================  ===========================================
RayError                  PodiumError (the base of every Podium error)
RayTaskError              RemoteError (user code in a worker raised)
RayActorError             WorkerDiedError
ActorDiedError            WorkerDiedError
WorkerCrashedError        WorkerDiedError
GetTimeoutError           DeadlineExceededError
ObjectLostError           ObjectLostError
OwnerDiedError            OwnerDiedError
TaskCancelledError        CancelledError
AuthenticationError       AuthenticationError
========================  ===========================================

Every other name is a class of its own, subclassing the mapped Ray parent (so
``ActorUnavailableError`` is a ``RayActorError``, ``RpcError`` a ``RayError``); Podium itself
raises none of them, and a program may raise and catch them as it would under Ray. Frameworks
build tuples of them at import time (NeMo-RL's failure table), which is why each must exist.
"""

from __future__ import annotations

from typing import Any

from podium import errors as _errors

#: Ray's release whose ``ray.exceptions`` this module follows.
RAY_VERSION = "2.60.0"

RayError = _errors.PodiumError
RayTaskError = _errors.RemoteError
RayActorError = _errors.WorkerDiedError
ActorDiedError = _errors.WorkerDiedError
WorkerCrashedError = _errors.WorkerDiedError
GetTimeoutError = _errors.DeadlineExceededError
ObjectLostError = _errors.ObjectLostError
OwnerDiedError = _errors.OwnerDiedError
TaskCancelledError = _errors.CancelledError
AuthenticationError = _errors.AuthenticationError


def _rebuild(cls: type, message: str) -> Exception:
    return cls(message)


class _RayOnly(_errors.PodiumError):
    """The base of the Ray classes Podium has no equivalent for. Ray's constructors take
    positional fields of their own (an error message, an actor id...): the first is kept as
    the message. They pickle by class, since :data:`podium.errors.CLASS_BY_NAME` (built when
    :mod:`podium.errors` loads) does not know them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        message = str(args[0]) if args else str(kwargs.get("error_message") or kwargs.get("message") or "")
        _errors.PodiumError.__init__(self, message)
        self.args = args

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), getattr(self, "message", "")))


def _make(name: str, *bases: type, doc: str) -> type:
    if not any(issubclass(base, _RayOnly) for base in bases):
        bases = (_RayOnly, *bases)  # a subclass of another Ray-only class inherits it already
    return type(name, bases, {"__doc__": doc, "__module__": __name__})


#: Podium's ``ActorUnavailableError`` where Podium restarts actors, else Ray's own class.
ActorUnavailableError: type = getattr(_errors, "ActorUnavailableError", None) or _make(
    "ActorUnavailableError", RayActorError,
    doc="The actor is unavailable for now (restarting) and may answer later.")

CrossLanguageError = _make("CrossLanguageError", RayError, doc="Raised from another language.")
LocalRayletDiedError = _make("LocalRayletDiedError", RayError, doc="The task's local raylet died.")
RaySystemError = _make("RaySystemError", RayError, doc="Ray encountered a system error.")
UserCodeException = _make("UserCodeException", RayError, doc="An exception in user code.")
ObjectStoreFullError = _make("ObjectStoreFullError", RayError, doc="The object store is full.")
OutOfDiskError = _make("OutOfDiskError", RayError, doc="The local disk is full.")
OutOfMemoryError = _make("OutOfMemoryError", RayError, doc="The node ran out of memory.")
NodeDiedError = _make("NodeDiedError", RayError, doc="The node is dead or unreachable.")
ObjectFetchTimedOutError = _make("ObjectFetchTimedOutError", ObjectLostError, doc="An object fetch timed out.")
RpcError = _make("RpcError", RayError, doc="An error in the underlying RPC system.")
ReferenceCountingAssertionError = _make("ReferenceCountingAssertionError", ObjectLostError, AssertionError,
                                        doc="An object was deleted while still referenced.")
ObjectFreedError = _make("ObjectFreedError", ObjectLostError, doc="An object was freed by the application.")
ObjectReconstructionFailedError = _make("ObjectReconstructionFailedError", ObjectLostError,
                                        doc="An object cannot be reconstructed.")
ObjectReconstructionFailedMaxAttemptsExceededError = _make(
    "ObjectReconstructionFailedMaxAttemptsExceededError", ObjectLostError,
    doc="An object cannot be reconstructed: its task's retries are used up.")
ObjectReconstructionFailedLineageEvictedError = _make(
    "ObjectReconstructionFailedLineageEvictedError", ObjectLostError,
    doc="An object cannot be reconstructed: its lineage was evicted.")
PlasmaObjectNotAvailable = _make("PlasmaObjectNotAvailable", RayError, doc="An object was not available in time.")
AsyncioActorExit = _make("AsyncioActorExit", RayError, doc="An asyncio actor exited on purpose.")
RuntimeEnvSetupError = _make("RuntimeEnvSetupError", RayError, doc="A runtime environment failed to set up.")
TaskPlacementGroupRemoved = _make("TaskPlacementGroupRemoved", RayError, doc="The task's placement group was removed.")
ActorPlacementGroupRemoved = _make("ActorPlacementGroupRemoved", RayError,
                                   doc="The actor's placement group was removed.")
PendingCallsLimitExceeded = _make("PendingCallsLimitExceeded", RayError,
                                  doc="An actor's pending calls exceeded max_pending_calls.")
TaskUnschedulableError = _make("TaskUnschedulableError", RayError, doc="The task cannot be scheduled.")
ActorUnschedulableError = _make("ActorUnschedulableError", RayError, doc="The actor cannot be scheduled.")
ObjectRefStreamEndOfStreamError = _make("ObjectRefStreamEndOfStreamError", RayError,
                                        doc="A streaming generator has no more refs.")
StreamingGeneratorReplayInconsistentError = _make("StreamingGeneratorReplayInconsistentError", RaySystemError,
                                                  doc="A retried streaming generator yielded differently.")
OufOfBandObjectRefSerializationException = _make("OufOfBandObjectRefSerializationException", RayError,
                                                 doc="An ObjectRef was serialized out of band.")
RayChannelError = _make("RayChannelError", RaySystemError, doc="A ray.experimental.channel error.")
RayChannelTimeoutError = _make("RayChannelTimeoutError", RayChannelError, TimeoutError,
                               doc="A channel operation timed out.")
RayCgraphCapacityExceeded = _make("RayCgraphCapacityExceeded", RaySystemError,
                                  doc="A compiled graph's capacity was exceeded.")
RayDirectTransportError = _make("RayDirectTransportError", RaySystemError,
                                doc="A Ray Direct Transport (tensor transport) error.")
UnserializableException = _make("UnserializableException", RayError, doc="An exception that could not be pickled.")
ActorAlreadyExistsError = _make("ActorAlreadyExistsError", ValueError, RayError,
                                doc="A named actor with that name already exists.")
ActorHandleNotFoundError = _make("ActorHandleNotFoundError", ValueError, RayError,
                                 doc="An actor handle could not be found.")

#: Ray's ``RAY_EXCEPTION_TYPES`` list (the exceptions its serializer knows).
RAY_EXCEPTION_TYPES = [
    PlasmaObjectNotAvailable, RayError, RayTaskError, WorkerCrashedError, RayActorError, ObjectStoreFullError,
    ObjectLostError, ObjectFetchTimedOutError, ReferenceCountingAssertionError, ObjectReconstructionFailedError,
    OwnerDiedError, GetTimeoutError, AsyncioActorExit, RuntimeEnvSetupError, TaskPlacementGroupRemoved,
    ActorPlacementGroupRemoved, PendingCallsLimitExceeded, LocalRayletDiedError, TaskUnschedulableError,
    ActorDiedError, ActorUnschedulableError, ActorUnavailableError, RayChannelError, RayChannelTimeoutError,
    OufOfBandObjectRefSerializationException, RayCgraphCapacityExceeded, UnserializableException,
    ActorAlreadyExistsError, ActorHandleNotFoundError, AuthenticationError,
]

#: Every public class name of Ray 2.60's ``ray.exceptions``.
NAMES = (
    "RayError", "CrossLanguageError", "TaskCancelledError", "RayTaskError", "LocalRayletDiedError",
    "WorkerCrashedError", "RayActorError", "ActorDiedError", "ActorUnavailableError", "RaySystemError",
    "AuthenticationError", "UserCodeException", "ObjectStoreFullError", "OutOfDiskError", "OutOfMemoryError",
    "NodeDiedError", "ObjectLostError", "ObjectFetchTimedOutError", "RpcError", "ReferenceCountingAssertionError",
    "ObjectFreedError", "OwnerDiedError", "ObjectReconstructionFailedError", "GetTimeoutError", "PlasmaObjectNotAvailable", "AsyncioActorExit", "RuntimeEnvSetupError",
    "TaskPlacementGroupRemoved", "ActorPlacementGroupRemoved", "PendingCallsLimitExceeded",
    "TaskUnschedulableError", "ActorUnschedulableError", "ObjectRefStreamEndOfStreamError",
    "StreamingGeneratorReplayInconsistentError", "OufOfBandObjectRefSerializationException", "RayChannelError",
    "RayChannelTimeoutError", "RayCgraphCapacityExceeded", "RayDirectTransportError", "UnserializableException",
    "ActorAlreadyExistsError", "ActorHandleNotFoundError",
)

#: Classes earlier Ray releases had (programs written for them still name them).
OLDER_NAMES = ("ObjectReconstructionFailedMaxAttemptsExceededError", "ObjectReconstructionFailedLineageEvictedError")

__all__ = [*NAMES, *OLDER_NAMES, "NAMES", "OLDER_NAMES", "RAY_EXCEPTION_TYPES", "RAY_VERSION"]
