"""``ray.actor``: Podium's actor classes and handles under Ray's names."""

from __future__ import annotations

from podium.controller.remote.actors import ActorClass, ActorHandle, ActorMethod

from podium.compat.ray import method
from podium.compat.standin import missing

__all__ = ["ActorClass", "ActorHandle", "ActorMethod", "method"]


def __getattr__(name: str):
    return missing(f"ray.actor.{name}", "podium.controller.remote.actors (ActorClass, ActorHandle, ActorMethod)")
