"""``ray._private``: the internals verl and SkyRL read (``state``, ``runtime_env.constants``,
``services.get_node_ip_address``, ``worker.global_worker``) and ROLL (``log_monitor``, ``async_compat``, ``profiling``)."""

from __future__ import annotations

from podium.compat.standin import missing
from ray._private import async_compat, log_monitor, profiling, runtime_env, services, state, worker

__all__ = ["async_compat", "log_monitor", "profiling", "runtime_env", "services", "state", "worker"]


def __getattr__(name: str):
    return missing(f"ray._private.{name}", "the public podium.compat.ray API")
