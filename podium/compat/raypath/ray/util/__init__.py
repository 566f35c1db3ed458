"""``ray.util``: placement groups, scheduling strategies, named actors, the node's IP,
``ActorPool``, (``import ray.util.collective``) collective communication, (``ray.util.metrics``)
application metrics and (``ray.util.queue``) a queue held by an actor, on Podium."""

from __future__ import annotations

from podium.compat.ray import _list_named_actors as list_named_actors
from podium.compat.standin import get_node_ip_address, missing
from ray.util import placement_group as _placement_group_module  # noqa: F401 - loads the submodule first
from ray.util import scheduling_strategies
from ray.util.actor_pool import ActorPool
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

__all__ = [
    "ActorPool",
    "NodeAffinitySchedulingStrategy",
    "PlacementGroup",
    "PlacementGroupSchedulingStrategy",
    "collective",
    "get_current_placement_group",
    "get_node_ip_address",
    "get_placement_group",
    "list_named_actors",
    "metrics",
    "placement_group",
    "placement_group_table",
    "queue",
    "remove_placement_group",
    "scheduling_strategies",
]

_ALTERNATIVES = {
    "multiprocessing": "podium.remote tasks",
    "state": "podium status / the scheduler's /v1 HTTP API",
    "inspect_serializability": "cloudpickle.dumps in a test",
    "accelerators": "ray.get_gpu_ids() / CUDA_VISIBLE_DEVICES",
}


def __getattr__(name: str):
    if name in ("collective", "metrics", "queue"):
        import importlib
        return importlib.import_module(f"ray.util.{name}")
    return missing(f"ray.util.{name}", _ALTERNATIVES.get(name, "see the README's table of Ray names"))
