"""``ray._private.log_monitor``: Ray's ``LogMonitor`` over Podium's worker logs, which ROLL's
launcher subclasses (:mod:`podium.compat.raylogs` says how the logs are found)."""

from __future__ import annotations

from podium.compat.raylogs import (
    LOG_NAME_UPDATE_INTERVAL_S,
    RAY_LOG_MONITOR_MANY_FILES_THRESHOLD,
    RAY_RUNTIME_ENV_LOG_TO_DRIVER_ENABLED,
    RUNTIME_ENV_SETUP_PATTERN,
    WORKER_LOG_PATTERN,
    LogFileInfo,
    LogMonitor,
    is_proc_alive,
)
from podium.compat.raylogs import logger as logger
from podium.compat.standin import missing

__all__ = ["LOG_NAME_UPDATE_INTERVAL_S", "LogFileInfo", "LogMonitor", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD",
           "RAY_RUNTIME_ENV_LOG_TO_DRIVER_ENABLED", "RUNTIME_ENV_SETUP_PATTERN", "WORKER_LOG_PATTERN",
           "is_proc_alive", "logger"]


def __getattr__(name: str):
    return missing(f"ray._private.log_monitor.{name}", "podium logs (a worker's output), or LogMonitor here")
