"""Under `podium run`: ray.util.collective "nccl" groups connect at their first operation,
as Ray's do, so one verl worker group's blocking init returns before the other group has
joined (the order verl's test_ray_collectives uses); gloo carries it where there is no CUDA."""

import ray
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl_workers import PairEnd

ray.init()
senders = RayWorkerGroup(RayResourcePool([2], max_colocate_count=1), RayClassWithInitArgs(cls=ray.remote(PairEnd)))
receivers = RayWorkerGroup(RayResourcePool([2], max_colocate_count=1), RayClassWithInitArgs(cls=ray.remote(PairEnd)))
assert senders.join(0) == [True, True]      # returns although no receiver has joined yet
assert receivers.join(1) == [True, True]
sent, received = senders.send(), receivers.recv()
ray.get(sent)
assert ray.get(received) == [[1.0] * 4, [2.0] * 4], ray.get(received)
ray.shutdown()
print("SCENARIO OK")
