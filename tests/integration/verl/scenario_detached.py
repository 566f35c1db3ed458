"""Under `podium run` (either mode): a detached verl RayWorkerGroup; a remote task attaches
to it by worker_names (RayWorkerGroup.from_detached in a task worker) and calls it; the
driver then kills the detached workers with ray.kill and removes the pool's placement groups
(they outlive ray.shutdown otherwise), as a verl user does on Ray."""

import ray
import verl.single_controller.ray as verl_ray
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)
from verl_workers import Counter

native = getattr(verl_ray, "__podium__", False)  # podium run --native-verl
ray.init()
pool = RayResourcePool([2], use_gpu=True, max_colocate_count=1, detached=True)
wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(Counter)), name_prefix="detached", detached=True)
names = wg.worker_names
if native:  # Podium's group names its workers by prefix and rank
    assert len(names) == 2 and all(n.startswith("detached") for n in names), names
else:
    assert names == ["detachedActorClass_0:0", "detachedActorClass_0:1"], names


@ray.remote
def attach_and_call(worker_names):
    import ray as task_ray
    import verl.single_controller.ray as task_verl_ray
    from verl.single_controller.ray import RayClassWithInitArgs as Cia
    from verl.single_controller.ray import RayWorkerGroup as Group
    from verl_workers import Counter as Cls

    assert getattr(task_ray, "__podium__", False)
    # The task's process is in the driver's mode too (it inherits PODIUM_NATIVE_VERL).
    assert getattr(task_verl_ray, "__podium__", False) == native
    attached = Group.from_detached(worker_names=worker_names, ray_cls_with_init=Cia(cls=task_ray.remote(Cls)))
    return attached.add(10)


assert ray.get(attach_and_call.remote(names)) == [10, 11]
assert wg.add(0) == [10, 11]  # the same workers: the task's calls changed them
if not native:  # Ray mode's workers are named actors
    assert sorted(n for n in ray.util.list_named_actors() if n.startswith("detached")) == names
for worker in wg.workers:
    ray.kill(worker)
for pg in pool.pgs:
    ray.util.remove_placement_group(pg)
ray.shutdown()

# Nothing of the detached group is left: attaching again finds no such workers.
ray.init()
try:
    RayWorkerGroup.from_detached(worker_names=names, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Counter)))
except Exception as exc:  # noqa: BLE001 - the type differs by mode; the message names the worker
    assert names[0] in str(exc), exc
else:
    raise AssertionError("the killed detached workers could still be attached")
ray.shutdown()
print("SCENARIO OK")
