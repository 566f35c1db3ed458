"""``ray.util.actor_pool``: calls spread over a fixed set of actors (:mod:`podium.compat.actorpool`)."""

from __future__ import annotations

from podium.compat.actorpool import ActorPool
from podium.compat.standin import missing

__all__ = ["ActorPool"]


def __getattr__(name: str):
    return missing(f"ray.util.actor_pool.{name}", "ray.util.ActorPool")
