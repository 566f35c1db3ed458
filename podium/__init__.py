"""Podium: a gRPC control plane for single-controller RL post-training.

The import root of every part: ``podium`` (the shared protocol: DataProto,
codec, errors, resources), ``podium.scheduler``, ``podium.worker`` and
``podium.controller``. See DESIGN.md for the map.

The names below are resolved lazily, so ``import podium`` stays light (the
node agent imports it and must never import torch).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "DataProto": "podium.dataproto",
    "DataProtoItem": "podium.dataproto",
    "DataProtoConfig": "podium.dataproto",
    "DataProtoFuture": "podium.refs",
    "ObjectRef": "podium.refs",
    "init": "podium.controller",
    "shutdown": "podium.controller",
    "get": "podium.controller",
    "wait": "podium.controller",
    "put": "podium.controller",
    "remote": "podium.controller",
    "get_actor": "podium.controller",
    "kill": "podium.controller",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'podium' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
