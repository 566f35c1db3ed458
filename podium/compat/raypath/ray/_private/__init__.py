"""``ray._private``: the internals verl and SkyRL read (``state``, ``runtime_env.constants``,
``services.get_node_ip_address``, ``worker.global_worker``) and ROLL (``log_monitor``)."""

from __future__ import annotations

from podium.compat.standin import missing
from ray._private import log_monitor, runtime_env, services, state, worker

__all__ = ["log_monitor", "runtime_env", "services", "state", "worker"]


def __getattr__(name: str):
    return missing(f"ray._private.{name}", "the public podium.compat.ray API")
