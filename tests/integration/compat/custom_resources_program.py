"""Run under ``podium run --num-cpus 8``: custom resources with plain ``import ray``, as ROLL
and slime ask for them. Prints ``CUSTOM RESOURCES OK`` last."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init(resources={"nvlink_domain_0": 2, "accel": 1})
total = ray.cluster_resources()
assert total["nvlink_domain_0"] == 2 and total["accel"] == 1, total
assert total.get("memory", 0) > 0, total  # each node offers its physical memory
(node,) = ray.nodes()
assert node["Resources"]["nvlink_domain_0"] == 2, node


@ray.remote(resources={"nvlink_domain_0": 1})
class Holder:
    def ping(self) -> int:
        return 1


@ray.remote(resources={"accel": 0.5})
def half() -> str:
    return "half"


a, b = Holder.remote(), Holder.remote()
assert ray.get([a.ping.remote(), b.ping.remote()]) == [1, 1]
assert ray.available_resources()["nvlink_domain_0"] == 0, ray.available_resources()

# More than the cluster has at all: refused at once, with the resource named.
try:
    Holder.options(resources={"nvlink_domain_0": 3}).remote()
except Exception as exc:  # noqa: BLE001 - the type is checked by name below
    assert type(exc).__name__ == "InfeasibleError", repr(exc)
    assert "nvlink_domain_0" in str(exc), str(exc)
else:
    raise AssertionError("an actor asking for 3 of 2 nvlink_domain_0 was created")
try:
    Holder.options(resources={"no_such_thing": 1}).remote()
except Exception as exc:  # noqa: BLE001
    assert "no no_such_thing" in str(exc), str(exc)
else:
    raise AssertionError("an actor asking for a resource no node has was created")

ray.kill(a)
c = Holder.remote()  # a's nvlink_domain_0 is free again
assert ray.get(c.ping.remote()) == 1

# Tasks take fractions; memory and node:<address> are resources too.
assert ray.get([half.remote(), half.remote()]) == ["half", "half"]
m = Holder.options(resources={}, memory=2**20, num_cpus=0.5).remote()
assert ray.get(m.ping.remote()) == 1
pinned = Holder.options(resources={f"node:{node['NodeManagerAddress']}": 0.01}).remote()
assert ray.get(pinned.ping.remote()) == 1

# Placement group bundles ask for them; actors in a bundle take them from it.
ray.kill(b)
ray.kill(c)
pg = placement_group([{"CPU": 1, "nvlink_domain_0": 1}, {"CPU": 1, "nvlink_domain_0": 1}], strategy="PACK")
ray.get(pg.ready())
assert ray.available_resources()["nvlink_domain_0"] == 0
inside = [Holder.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote() for i in range(2)]
assert ray.get([h.ping.remote() for h in inside]) == [1, 1]
try:
    Holder.options(resources={"accel": 1},
                   scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
except Exception as exc:  # noqa: BLE001
    assert "accel" in str(exc), str(exc)
else:
    raise AssertionError("an actor took accel from a bundle without any")
print("CUSTOM RESOURCES OK")
