"""Run under ``podium run --num-cpus 4``: the Ray internals frameworks read (issue #49 item 9),
with plain ``import ray``. Prints ``INTERNALS OK`` last."""

from __future__ import annotations

import os

import ray
import ray.exceptions
from ray import SCRIPT_MODE, WORKER_MODE
from ray._private.worker import global_worker

# NeMo-RL's failure table: a module-level tuple of Ray's exception classes.
RETRYABLE = (ray.exceptions.ActorUnavailableError, ray.exceptions.RpcError, ray.exceptions.ActorDiedError,
             ray.exceptions.RaySystemError, ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError)

HERE = os.path.dirname(os.path.abspath(__file__))
assert global_worker.mode is None  # not connected yet, as in Ray
ray.init()
assert global_worker.mode == SCRIPT_MODE
address = global_worker.gcs_client.address  # OpenRLHF's read
assert address and ":" in address, address
context = ray.get_runtime_context()
assert context.gcs_address == address and context.get_actor_id() is None and context.namespace == "default"
assert context.get_job_id() and context.get_node_id()
assert context.worker.mode != WORKER_MODE  # ROLL's is_driver()
assert context.runtime_env.to_dict() == {} and context.get_runtime_env_string() == "{}"  # vLLM's read


@ray.remote(num_cpus=1)
class Probe:
    """Reports what the actor sees of itself."""

    def look(self) -> dict:
        import ray as ray_there
        from ray._private.worker import global_worker as there

        ctx = ray_there.get_runtime_context()
        return {"mode": there.mode, "worker_mode": ray_there.WORKER_MODE, "gcs": there.gcs_client.address,
                "actor_id": ctx.get_actor_id(), "name": ctx.get_actor_name(), "task_id": ctx.get_task_id(),
                "resources": ctx.get_assigned_resources(), "node": ctx.get_node_id(), "ip": there.node.node_ip_address,
                "runtime_env": ctx.runtime_env.to_dict()}


@ray.remote
def task_view() -> tuple:
    import ray as ray_there

    ctx = ray_there.get_runtime_context()
    return ctx.get_actor_id(), ctx.gcs_address


probe = Probe.options(name="probe", runtime_env={"working_dir": HERE}).remote()
seen = ray.get(probe.look.remote())
assert seen["mode"] == seen["worker_mode"] == WORKER_MODE, seen
assert seen["gcs"] == address, (seen, address)
assert seen["actor_id"] == probe._actor_id.hex() and seen["name"] == "probe", seen
assert seen["resources"] == {"CPU": 1.0} and seen["task_id"] and seen["ip"], seen
assert seen["node"] in {n["NodeID"] for n in ray.nodes()}, seen
assert seen["runtime_env"] == {"working_dir": HERE}, seen  # the actor's own runtime_env
actor_in_task, gcs_in_task = ray.get(task_view.remote())
assert actor_in_task is None and gcs_in_task == address, (actor_in_task, gcs_in_task)

# Ray Direct Transport's options: accepted, the tensors take Podium's data path.
import torch  # noqa: E402


@ray.remote(num_cpus=1, enable_tensor_transport=True)
class Producer:
    """An actor whose method asks for NIXL transport of its tensor result."""

    @ray.method(tensor_transport="nixl")
    def make(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32)

    def total(self, tensor: torch.Tensor) -> float:
        return float(tensor.sum())


producer = Producer.remote()
made = producer.make.remote(5)
assert torch.equal(ray.get(made), torch.arange(5, dtype=torch.float32))
held = ray.put(torch.ones(4), _tensor_transport="nixl")
assert ray.get(producer.total.remote(held)) == 4.0 and ray.get(producer.total.remote(made)) == 10.0
try:
    ray.put(torch.ones(1), _owner=producer)
except NotImplementedError as exc:
    assert "_owner" in str(exc), exc
else:
    raise AssertionError("ray.put(_owner=...) was accepted")

# Podium's death is Ray's: except ray.exceptions.ActorDiedError catches it.
ray.kill(probe)
try:
    ray.get(probe.look.remote())
except RETRYABLE as exc:
    assert isinstance(exc, ray.exceptions.ActorDiedError) and isinstance(exc, ray.exceptions.RayActorError), exc
else:
    raise AssertionError("a call on a killed actor answered")
print("INTERNALS OK")
