"""``ray.exceptions`` on Podium (issue #49 item 9): every class of Ray 2.60's module exists, in
Ray's hierarchy, and the ones Podium raises are Podium's own, so Ray's ``except`` clauses
catch Podium's errors."""

from __future__ import annotations

import pickle

import pytest
from podium import errors

from podium.compat import rayexceptions

# Ray 2.60.0's python/ray/exceptions.py (from its wheel): each class and its bases.
RAY_260 = {
    "RayError": ("Exception",), "CrossLanguageError": ("RayError",), "TaskCancelledError": ("RayError",),
    "RayTaskError": ("RayError",), "LocalRayletDiedError": ("RayError",), "WorkerCrashedError": ("RayError",),
    "RayActorError": ("RayError",), "ActorDiedError": ("RayActorError",), "ActorUnavailableError": ("RayActorError",),
    "RaySystemError": ("RayError",), "AuthenticationError": ("RayError",), "UserCodeException": ("RayError",),
    "ObjectStoreFullError": ("RayError",), "OutOfDiskError": ("RayError",), "OutOfMemoryError": ("RayError",),
    "NodeDiedError": ("RayError",), "ObjectLostError": ("RayError",), "ObjectFetchTimedOutError": ("ObjectLostError",),
    "RpcError": ("RayError",), "ReferenceCountingAssertionError": ("ObjectLostError", "AssertionError"),
    "ObjectFreedError": ("ObjectLostError",), "OwnerDiedError": ("ObjectLostError",),
    "ObjectReconstructionFailedError": ("ObjectLostError",), "GetTimeoutError": ("RayError", "TimeoutError"),
    "PlasmaObjectNotAvailable": ("RayError",), "AsyncioActorExit": ("RayError",),
    "RuntimeEnvSetupError": ("RayError",), "TaskPlacementGroupRemoved": ("RayError",),
    "ActorPlacementGroupRemoved": ("RayError",), "PendingCallsLimitExceeded": ("RayError",),
    "TaskUnschedulableError": ("RayError",), "ActorUnschedulableError": ("RayError",),
    "ObjectRefStreamEndOfStreamError": ("RayError",), "StreamingGeneratorReplayInconsistentError": ("RaySystemError",),
    "OufOfBandObjectRefSerializationException": ("RayError",), "RayChannelError": ("RaySystemError",),
    "RayChannelTimeoutError": ("RayChannelError", "TimeoutError"), "RayCgraphCapacityExceeded": ("RaySystemError",),
    "RayDirectTransportError": ("RaySystemError",), "UnserializableException": ("RayError",),
    "ActorAlreadyExistsError": ("ValueError", "RayError"), "ActorHandleNotFoundError": ("ValueError", "RayError"),
}
BUILTIN = {"Exception": Exception, "AssertionError": AssertionError, "TimeoutError": TimeoutError,
           "ValueError": ValueError}


def test_every_ray_class_exists_with_rays_bases():
    assert set(rayexceptions.NAMES) == set(RAY_260)
    for name, bases in RAY_260.items():
        cls = getattr(rayexceptions, name)
        for base in bases:
            parent = BUILTIN.get(base) or getattr(rayexceptions, base)
            assert issubclass(cls, parent), f"{name} is not a {base}"


@pytest.mark.parametrize("ray_name,podium_error", [
    ("ActorDiedError", errors.WorkerDiedError("worker gone")),
    ("RayActorError", errors.WorkerDiedError("worker gone")),
    ("GetTimeoutError", errors.DeadlineExceededError("late")),
    ("RayTaskError", errors.RemoteError("boom", remote_type="ValueError")),
    ("OwnerDiedError", errors.OwnerDiedError("owner gone")),
    ("ObjectLostError", errors.OwnerDiedError("owner gone")),
    ("TaskCancelledError", errors.CancelledError("cancelled")),
    ("RayError", errors.InfeasibleError("never fits")),
])
def test_rays_except_clauses_catch_podiums_errors(ray_name, podium_error):
    with pytest.raises(getattr(rayexceptions, ray_name)):
        raise podium_error


def test_ray_only_classes_carry_their_message_and_pickle():
    for name in (*rayexceptions.NAMES, *rayexceptions.OLDER_NAMES):
        cls = getattr(rayexceptions, name)
        if cls.__module__ != rayexceptions.__name__:
            continue  # Podium's own class
        exc = cls(f"{name} happened")
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is cls and str(again) == f"{name} happened"
