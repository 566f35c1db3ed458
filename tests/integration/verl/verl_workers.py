"""verl Worker subclasses the verl tests drive (importable by the workers: this file is on
their path, the tests' folder is the working directory)."""

from __future__ import annotations

import os

import torch
from tensordict import TensorDict
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)


class Counter(Worker):
    """One value per rank; every dispatch mode has a method."""

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.value = start + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x: int) -> int:
        self.value += x
        return self.value

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def pair(self, x: int) -> tuple[int, int]:
        return self.rank, x

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": fn(data.batch["x"])})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto) -> dict:
        return {"rank": self.rank, "sum": int(data.batch["x"].sum())}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_mesh(self) -> None:
        # one data-parallel group of every rank; only rank 0 returns its result
        self._register_dispatch_collect_info("one", dp_rank=0, is_collect=self.rank == 0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("one"))
    def by_mesh(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"] + 100 * self.rank})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"] * 2, "rank": torch.full_like(data.batch["x"], self.rank)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def square(self, xs: list) -> list:
        return [x * x for x in xs]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_zero(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def later(self, x: int) -> int:
        return x + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self, key: str) -> str | None:
        return os.environ.get(key)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ray_module(self) -> bool:
        import ray
        return bool(getattr(ray, "__podium__", False))


class Doubler(Worker):
    """A second role, for colocated workers."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def twice(self, x: int) -> int:
        return 2 * x

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def plus_one(self, data: DataProto) -> DataProto:
        return DataProto(batch=TensorDict({"x": data.batch["x"] + 1}, batch_size=data.batch.batch_size))


class Peer(Worker):
    """A member of a ray.util.collective group (gloo on CPU)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def collective(self, group_name: str) -> dict:
        from ray.util import collective

        collective.init_collective_group(self.world_size, self.rank, "nccl", group_name)
        assert collective.is_group_initialized(group_name)
        value = torch.full((4,), float(self.rank + 1))
        collective.broadcast(value, src_rank=1, group_name=group_name)
        total = torch.tensor([float(self.rank + 1)])
        collective.allreduce(total, group_name=group_name)
        gathered = [torch.zeros(1) for _ in range(self.world_size)]
        collective.allgather(gathered, torch.tensor([float(self.rank)]), group_name=group_name)
        collective.barrier(group_name)
        out = {"broadcast": value.tolist(), "sum": total.item(), "gathered": [t.item() for t in gathered],
               "rank": collective.get_rank(group_name), "size": collective.get_collective_group_size(group_name)}
        collective.destroy_collective_group(group_name)
        out["after"] = collective.is_group_initialized(group_name)
        return out


class WeightSync(Worker):
    """A trainer rank with its colocated rollout copy: verl's "naive" checkpoint engine
    (``ColocatedCheckpointEngine``) hands the trained weights to the rollout side."""

    def __init__(self) -> None:
        super().__init__()
        from verl.checkpoint_engine.base import CheckpointEngineRegistry

        self.engine = CheckpointEngineRegistry.new("naive", bucket_size=1 << 20)
        self.params = {"w": torch.full((4,), float(self.rank)), "b": torch.zeros(2)}
        self.rollout: dict = {}
        self.version = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, delta: float) -> None:
        for tensor in self.params.values():
            tensor += delta

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def update_weights(self, global_steps: int | None = None, mode: str = "naive") -> dict:
        # What verl's actor does for backend "naive": send into the engine, the rollout reads it.
        assert mode == "naive", mode
        self.engine.send_weights(iter(self.params.items()), global_steps=global_steps)
        self.rollout = {name: tensor.clone() for name, tensor in self.engine.receive_weights(global_steps)}
        self.version = global_steps
        return {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_weights(self) -> tuple:
        return {name: t.tolist() for name, t in self.rollout.items()}, self.version


class Deferred(Worker):
    """``blocking=False`` methods whose ranks' results are concatenated: DataProto (a plain
    and an ``async def`` method) and TensorDict (an nd-mesh method, each rank its own dp rank)."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info("per_rank", dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def tag(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"] * 10 + self.rank})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def tag_async(self, data: DataProto) -> DataProto:
        import asyncio

        await asyncio.sleep(0.01)
        return DataProto.from_dict({"x": data.batch["x"] * 10 + self.rank})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("per_rank"), blocking=False)
    def tag_tensordict(self, td: TensorDict) -> TensorDict:
        return TensorDict({"x": td["x"] * 10 + self.rank}, batch_size=td.batch_size)


class Joined(Worker):
    """Joins torch.distributed (gloo) in its constructor, as verl's FSDP workers do: rank 0's
    ``__init__`` waits there for ranks that verl's RayWorkerGroup creates after it."""

    def __init__(self) -> None:
        super().__init__()
        import torch.distributed as dist

        dist.init_process_group(backend="gloo")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def total(self) -> float:
        import torch.distributed as dist

        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return value.item()


class PairEnd(Worker):
    """One end of a two-member ray.util.collective group per rank ("pair<rank>"), as verl's
    test_ray_collectives pairs an actor group with a rollout group: each side's ``join`` is a
    blocking call that returns before the other side joined; send/recv connect the group."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join(self, side: int) -> bool:
        from ray.util import collective

        collective.init_collective_group(2, side, "nccl", f"pair{self.rank}")
        return collective.is_group_initialized(f"pair{self.rank}")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send(self) -> None:
        from ray.util import collective

        collective.send(torch.full((4,), float(self.rank + 1)), 1, f"pair{self.rank}")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def recv(self) -> list:
        from ray.util import collective

        value = torch.zeros(4)
        collective.recv(value, 0, f"pair{self.rank}")
        return value.tolist()
