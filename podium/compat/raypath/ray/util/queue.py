"""``ray.util.queue``: a queue held by an actor, usable from any process (:mod:`podium.compat.actorqueue`)."""

from __future__ import annotations

from podium.compat.actorqueue import Empty, Full, Queue
from podium.compat.standin import missing

__all__ = ["Empty", "Full", "Queue"]


def __getattr__(name: str):
    return missing(f"ray.util.queue.{name}", "ray.util.queue.Queue, Empty and Full")
