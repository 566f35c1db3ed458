"""Run under ``podium run --num-cpus 8``: placement group capture with plain ``import ray``, as
vLLM's Ray executor and OpenRLHF use it. Prints ``CAPTURE OK`` last."""

from __future__ import annotations

import ray
from ray.util.placement_group import get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init()
assert get_current_placement_group() is None  # the driver is in no group


def _current() -> str | None:
    pg = ray.util.get_current_placement_group()
    return None if pg is None else pg.id


@ray.remote(num_cpus=1)
def task_where() -> str | None:
    return _current()


@ray.remote(num_cpus=1)
class Child:
    def where(self) -> str | None:
        return _current()

    def grandchild_where(self) -> str | None:
        return ray.get(Child.remote().where.remote())


@ray.remote(num_cpus=1)
class Parent:
    def current(self) -> str | None:
        return _current()

    def child_where(self) -> str | None:
        return ray.get(Child.remote().where.remote())

    def task_where(self) -> str | None:
        return ray.get(task_where.remote())

    def grandchild_where(self) -> str | None:
        return ray.get(Child.remote().grandchild_where.remote())

    def escaped_child_where(self) -> str | None:
        none = PlacementGroupSchedulingStrategy(placement_group=None)
        return ray.get(Child.options(scheduling_strategy=none).remote().where.remote())

    def bundles_of_current(self) -> int:
        return get_current_placement_group().bundle_count


pg = placement_group([{"CPU": 1}] * 5, strategy="STRICT_PACK")
ray.get(pg.ready())
parent = Parent.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
    pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote()
assert ray.get(parent.current.remote()) == pg.id
assert ray.get(parent.bundles_of_current.remote()) == 5
assert ray.get(parent.child_where.remote()) == pg.id          # an actor it starts: bundle 1
assert ray.get(parent.task_where.remote()) == pg.id           # a task it runs: bundle 2
assert ray.get(parent.grandchild_where.remote()) == pg.id     # captured in turn: bundles 3 and 4
assert ray.get(parent.escaped_child_where.remote()) is None   # PlacementGroupSchedulingStrategy(None)

# Without capture the actor still knows its group, and what it starts lands outside it.
other = placement_group([{"CPU": 1}], strategy="PACK")
ray.get(other.ready())
plain = Parent.options(placement_group=other, placement_group_bundle_index=0).remote()
assert ray.get(plain.current.remote()) == other.id
assert ray.get(plain.child_where.remote()) is None
# The option form: placement_group_capture_child_tasks=True in .options.
third = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
ray.get(third.ready())
captor = Parent.options(placement_group=third, placement_group_capture_child_tasks=True).remote()
assert ray.get(captor.child_where.remote()) == third.id
print("CAPTURE OK")
