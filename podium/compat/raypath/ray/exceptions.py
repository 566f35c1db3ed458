"""``ray.exceptions``: Ray's exception names for Podium's errors (``podium.errors``)."""

from __future__ import annotations

from podium.compat.ray import exceptions as _names
from podium.compat.standin import missing

RayError = _names.RayError
RayTaskError = _names.RayTaskError
RayActorError = _names.RayActorError
ActorDiedError = _names.ActorDiedError
GetTimeoutError = _names.GetTimeoutError
ObjectLostError = _names.ObjectLostError
OwnerDiedError = _names.OwnerDiedError
TaskCancelledError = _names.TaskCancelledError
WorkerCrashedError = _names.WorkerCrashedError

__all__ = [
    "ActorDiedError",
    "GetTimeoutError",
    "ObjectLostError",
    "OwnerDiedError",
    "RayActorError",
    "RayError",
    "RayTaskError",
    "TaskCancelledError",
    "WorkerCrashedError",
]


def __getattr__(name: str):
    return missing(f"ray.exceptions.{name}", "the podium.errors classes listed in ray.exceptions.__all__")
