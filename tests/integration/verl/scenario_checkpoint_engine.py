"""Under `podium run` (either mode): verl's CheckpointEngineManager with its "naive" backend
updates the rollout weights of a verl worker group (what verl's trainer does each step when
actor and rollout share the processes)."""

import ray
from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig
from verl_workers import WeightSync

ray.init()
wg = RayWorkerGroup(RayResourcePool([2], use_gpu=True, max_colocate_count=1),
                    RayClassWithInitArgs(cls=ray.remote(WeightSync)))
manager = CheckpointEngineManager(config=CheckpointEngineConfig(backend="naive"), actor_wg=wg, replicas=[])
for step in (1, 2):
    wg.train_step(0.5)
    assert manager.update_weights(global_steps=step) == {}
    got = wg.rollout_weights()
    assert [version for _, version in got] == [step, step], got
    assert [weights["w"] for weights, _ in got] == [[r + 0.5 * step] * 4 for r in (0, 1)], got
    assert all(weights["b"] == [0.5 * step] * 2 for weights, _ in got), got
ray.shutdown()
print("SCENARIO OK")
