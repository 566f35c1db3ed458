"""Podium: a gRPC control plane for single-controller RL post-training.

This package is what a training script imports::

    import podium
    podium.init()                      # an embedded cluster; init(address="host:50051") joins one
    out = podium.get(wg.step(batch, blocking=False))

It holds the cluster session (``init``, ``shutdown``, ``get``, ``wait``, ``call_timeout``; Ray's
``put``, ``remote``, ``get_actor``, ``kill`` and ``timeline``), the batch container (``DataProto``),
references to results held in workers (``ObjectRef``, ``DataProtoFuture``), the workers'
live stacks (``stacks``), the TLS settings (``TlsConfig``) and every error Podium raises (one
tree, rooted at ``PodiumError``; see :mod:`podium.errors`). The two other facades serve other audiences:
``podium.controller`` builds resource pools and worker groups, ``podium.worker`` is what a
worker class is written against. ``docs/architecture.md`` maps the whole system.

Names that need torch or gRPC are resolved lazily, so ``import podium`` stays light (the node
agent imports it and must never import torch).
"""

from __future__ import annotations

import importlib

from podium.errors import (AbortedError, ActorUnavailableError, AlreadyExistsError, ArgumentMismatchError,
                           AuthenticationError, CancelledError, DataLossError, DeadlineExceededError, FailedPreconditionError,
                           InfeasibleError, InternalError, InvalidArgumentAssertion, InvalidArgumentError,
                           InvalidSpecError, NotFoundError, NotProvidedError, ObjectLostError, OutOfRangeError,
                           OwnerDiedError, PayloadTooLargeError, PermissionDeniedError, PodiumError,
                           RankZeroDispatchError, RemoteError,
                           ResourceExhaustedError, SlotFullError, UnavailableError, UnimplementedError,
                           UnknownMethodError, UnresponsiveError, WeightBroadcastError, WorkerDiedError)

__version__ = "0.1.0"

#: name -> module that defines it, imported on first use.
_LAZY = {
    "DataProto": "podium.dataproto",
    "DataProtoConfig": "podium.dataproto",
    "DataProtoItem": "podium.dataproto",
    "DataProtoFuture": "podium.refs",
    "ObjectRef": "podium.refs",
    "TlsConfig": "podium.auth",
    "call_timeout": "podium.controller.session.calltimeout",
    "get": "podium.controller.session.gets",
    "get_actor": "podium.controller.remote.actors",
    "init": "podium.controller.session.runtime",
    "is_initialized": "podium.controller.session.runtime",
    "kill": "podium.controller.remote.actors",
    "put": "podium.controller.remote.objects",
    "remote": "podium.controller.remote.tasks",
    "shutdown": "podium.controller.session.runtime",
    "stacks": "podium.controller.observe.livestacks",
    "timeline": "podium.controller.observe.timeline",
    "wait": "podium.controller.session.gets",
}

__all__ = [
    "AbortedError",
    "ActorUnavailableError",
    "AlreadyExistsError",
    "ArgumentMismatchError",
    "AuthenticationError",
    "CancelledError",
    "DataLossError",
    "DataProto",
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InfeasibleError",
    "InternalError",
    "InvalidArgumentAssertion",
    "InvalidArgumentError",
    "InvalidSpecError",
    "NotFoundError",
    "NotProvidedError",
    "ObjectLostError",
    "ObjectRef",
    "OutOfRangeError",
    "OwnerDiedError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "PodiumError",
    "RankZeroDispatchError",
    "RemoteError",
    "ResourceExhaustedError",
    "SlotFullError",
    "TlsConfig",
    "UnavailableError",
    "UnimplementedError",
    "UnknownMethodError",
    "UnresponsiveError",
    "WeightBroadcastError",
    "WorkerDiedError",
    "__version__",
    "call_timeout",
    "get",
    "get_actor",
    "init",
    "is_initialized",
    "kill",
    "put",
    "remote",
    "shutdown",
    "stacks",
    "timeline",
    "wait",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'podium' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
