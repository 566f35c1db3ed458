"""``ray._private.worker``: ``global_worker`` (``mode``, ``gcs_client.address``, ``node``) and
the process modes, as :mod:`podium.compat.raycontext` answers them; ``print_to_stdstream``,
``print_worker_logs`` and ``logger``, which ROLL's log monitor prints with
(:mod:`podium.compat.raylogs`); ``RemoteFunctionNoArgs``, a typing class ROLL annotates with."""

from __future__ import annotations

from podium.compat.raycontext import (
    LOCAL_MODE,
    RESTORE_WORKER_MODE,
    SCRIPT_MODE,
    SPILL_WORKER_MODE,
    WORKER_MODE,
    global_worker,
)
from podium.compat.rayinternals import RemoteFunctionNoArgs
from podium.compat.raylogs import logger, print_to_stdstream, print_worker_logs
from podium.compat.standin import missing

__all__ = ["LOCAL_MODE", "RemoteFunctionNoArgs", "RESTORE_WORKER_MODE", "SCRIPT_MODE", "SPILL_WORKER_MODE", "WORKER_MODE",
           "global_worker", "logger", "print_to_stdstream", "print_worker_logs"]


def __getattr__(name: str):
    return missing(f"ray._private.worker.{name}", "the public ray API (ray.init, ray.get_runtime_context)")
