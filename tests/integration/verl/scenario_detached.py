"""Under `podium run`: a detached verl RayWorkerGroup; a remote task attaches to it by
worker_names (RayWorkerGroup.from_detached, ray.get_actor in a task worker) and calls it;
the driver then kills the detached workers (they outlive ray.shutdown otherwise)."""

import ray
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)
from verl_workers import Counter

ray.init()
pool = RayResourcePool([2], use_gpu=True, max_colocate_count=1, detached=True)
wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(Counter)), name_prefix="detached", detached=True)
names = wg.worker_names
assert names == ["detachedActorClass_0:0", "detachedActorClass_0:1"], names


@ray.remote
def attach_and_call(worker_names):
    import ray as task_ray
    from verl.single_controller.ray import RayClassWithInitArgs as Cia
    from verl.single_controller.ray import RayWorkerGroup as Group
    from verl_workers import Counter as Cls

    assert getattr(task_ray, "__podium__", False)
    attached = Group.from_detached(worker_names=worker_names, ray_cls_with_init=Cia(cls=task_ray.remote(Cls)))
    return attached.add(10)


assert ray.get(attach_and_call.remote(names)) == [10, 11]
assert wg.add(0) == [10, 11]  # the same workers: the task's calls changed them
assert sorted(n for n in ray.util.list_named_actors() if n.startswith("detached")) == names
for worker in wg.workers:
    ray.kill(worker)
for pg in pool.pgs:
    ray.util.remove_placement_group(pg)
ray.shutdown()
print("SCENARIO OK")
