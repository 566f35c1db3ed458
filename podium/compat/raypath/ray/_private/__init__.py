"""``ray._private``: the internals verl and SkyRL read (``state``, ``runtime_env.constants``,
``services.get_node_ip_address``, ``worker.global_worker``)."""

from __future__ import annotations

from podium.compat.standin import missing
from ray._private import runtime_env, services, state, worker

__all__ = ["runtime_env", "services", "state", "worker"]


def __getattr__(name: str):
    return missing(f"ray._private.{name}", "the public podium.compat.ray API")
