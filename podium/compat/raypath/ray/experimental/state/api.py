"""``ray.experimental.state.api``: ``get_actor`` (the state of one actor, by id) on Podium."""

from __future__ import annotations

from podium.compat.standin import actor_state, missing

__all__ = ["get_actor"]


def get_actor(id: str, *args, **kwargs) -> dict | None:
    """The state of the actor whose ``handle._actor_id.hex()`` is ``id``: a dict with
    ``actor_id``, ``name``, ``state`` ("ALIVE", "PENDING_CREATION" or "DEAD") and ``node_id``
    (None when Podium knows no such actor)."""
    return actor_state(id)


def __getattr__(name: str):
    return missing(f"ray.experimental.state.api.{name}", "podium status / the scheduler's /v1 HTTP API")
