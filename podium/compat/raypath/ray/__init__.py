"""The ``ray`` stand-in: a real package tree whose names forward to :mod:`podium.compat.ray`.

It is importable as ``ray`` only where ``podium/compat/raypath`` comes first on the path:
under ``podium run -- COMMAND`` (which puts it on ``PYTHONPATH`` for COMMAND and every worker
Podium starts for it) or after :func:`podium.compat.activate` (for notebooks). Anywhere else
``import ray`` finds whatever Ray is installed, or nothing. ``ray.__podium__`` is True here.

Names Podium does not provide raise :class:`podium.errors.NotProvidedError` (a
``NotImplementedError`` and an ``AttributeError``) naming the Ray API and the Podium
alternative (module ``__getattr__`` in every package of this tree); importing such a name as a
module (``import ray.data``, ``from ray import serve``) raises ``ModuleNotFoundError`` with the
same message (:class:`podium.compat.standin.NotProvidedFinder`). Nothing is a silent no-op.
"""

from __future__ import annotations

import os as _os

# In a worker Podium started, the first use of the runtime joins the worker's own cluster
# (the agent names its scheduler), never an embedded cluster of its own.
if (_os.environ.get("PODIUM_WORKER_ID") and _os.environ.get("PODIUM_SCHEDULER")
        and not _os.environ.get("PODIUM_ADDRESS")):
    _os.environ["PODIUM_ADDRESS"] = _os.environ["PODIUM_SCHEDULER"]

import sys as _sys

from podium.compat import nativeverl as _nativeverl
from podium.compat import ray as _compat
from podium.compat.ray import (
    ObjectRef,
    ObjectRefGenerator,
    available_resources,
    cancel,
    cluster_resources,
    get,
    get_actor,
    get_gpu_ids,
    get_runtime_context,
    init,
    is_initialized,
    kill,
    method,
    nodes,
    put,
    shutdown,
    wait,
)
from podium.compat.standin import NotProvidedFinder as _NotProvidedFinder
from podium.compat.raycontext import LOCAL_MODE, RESTORE_WORKER_MODE, SCRIPT_MODE, SPILL_WORKER_MODE, WORKER_MODE
from podium.compat.standin import remote, timeline
from ray import _private, _raylet, actor, cloudpickle, exceptions, experimental, util
from ray import runtime_env  # noqa: E402 - ray.runtime_env.RuntimeEnv

# Last on the meta path: it answers only for ray.* modules no other finder found.
if not any(isinstance(f, _NotProvidedFinder) for f in _sys.meta_path):
    _sys.meta_path.append(_NotProvidedFinder())

# podium run --native-verl: verl's single_controller.ray is Podium's SDK (verl imports
# ray from verl.protocol, before anything can import single_controller.ray).
if _nativeverl.wanted():
    _nativeverl.install()

#: Marks the stand-in (``getattr(ray, "__podium__", False)`` tells it from a real Ray).
__podium__ = True
#: Ray's version this stand-in follows (the API verl 0.9.1 uses).
__version__ = "2.49.0"

__all__ = [
    "LOCAL_MODE",
    "ObjectRef",
    "ObjectRefGenerator",
    "RESTORE_WORKER_MODE",
    "SCRIPT_MODE",
    "SPILL_WORKER_MODE",
    "WORKER_MODE",
    "_private",
    "_raylet",
    "actor",
    "available_resources",
    "cancel",
    "cloudpickle",
    "cluster_resources",
    "exceptions",
    "experimental",
    "get",
    "get_actor",
    "get_gpu_ids",
    "get_runtime_context",
    "init",
    "is_initialized",
    "kill",
    "method",
    "nodes",
    "put",
    "remote",
    "shutdown",
    "timeline",
    "util",
    "wait",
]


def __getattr__(name: str):
    return _compat.__getattr__(name)
