"""Environment variables an actor's process sets for itself just before its class is built.

Ray lets an actor's ``runtime_env`` set any variable, and verl's ``RayWorkerGroup`` gives each
actor its ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` that way. Podium's node
agent sets those itself for every worker (a worker spec may not override them), so the
controller sends them with the constructor instead: :class:`WithProcessEnv` sets them in the
worker's process, then builds the actor's class.
"""

from __future__ import annotations

import os
from typing import Any

from podium.worker.actorshell import construct

__all__ = ["WithProcessEnv"]


class WithProcessEnv:
    """``WithProcessEnv(env, cls, args, kwargs)`` sets ``env`` in this process and returns
    ``cls(*args, **kwargs)`` (an instance of ``cls``, not of this class; an ``async def
    __init__`` awaited, see :func:`podium.worker.actorshell.construct`)."""

    def __new__(cls, env: dict[str, str], target: Any, args: tuple, kwargs: dict) -> Any:
        os.environ.update(env)
        return construct(target, args, kwargs)
