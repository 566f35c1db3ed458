"""Under `podium run` (either mode): what a verl `blocking=False` call gives back when its
ranks' results are concatenated. verl's collect functions accept a rank's result only if it is
a `ray.ObjectRef` (Ray mode) and verl code checks the future against verl's own
`DataProtoFuture` class (both modes); `.get()` gives the rows in rank order."""

import os

import ray
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.protocol import DataProtoConfig, DataProtoFuture
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl_workers import Counter, Deferred

native = os.environ.get("PODIUM_NATIVE_VERL") == "1"
ray.init()
# What .remote() and ray.put return are both ray.ObjectRefs, as in Ray.
assert isinstance(ray.put(7), ray.ObjectRef)
counters = RayWorkerGroup(RayResourcePool([1], max_colocate_count=1), RayClassWithInitArgs(cls=ray.remote(Counter)))
if not native:  # in native mode a worker is a Podium handle (the README says so)
    assert isinstance(counters.workers[0].add.remote(0), ray.ObjectRef)
assert all(isinstance(ref, ray.ObjectRef) for ref in counters.later(1))
try:
    ray.ObjectRef(b"\0" * 28)
except NotImplementedError as exc:
    assert "ray.ObjectRef" in str(exc) and "on Podium use" in str(exc), exc
else:
    raise AssertionError("ray.ObjectRef(...) constructed a ref")

wg = RayWorkerGroup(RayResourcePool([2], max_colocate_count=1), RayClassWithInitArgs(cls=ray.remote(Deferred)))
data = DataProto.from_dict({"x": torch.arange(4)})
for method in (wg.tag, wg.tag_async):
    future = method(data)
    assert isinstance(future, DataProtoFuture), type(future)
    out = future.get()
    assert isinstance(out, DataProto) and out.batch["x"].tolist() == [0, 10, 21, 31], out

future = wg.tag_tensordict(TensorDict({"x": torch.arange(4)}, batch_size=[4]))
assert isinstance(future, DataProtoFuture), type(future)
out = future.get()
assert isinstance(out, TensorDict) and out["x"].tolist() == [0, 10, 21, 31], out

if native:  # Podium trims verl's padding off the future too (verl returns it padded)
    odd = DataProto.from_dict({"x": torch.arange(3)}, meta_info={DataProtoConfig.auto_padding_key: True})
    future = wg.tag(odd)
    assert isinstance(future, DataProtoFuture), type(future)
    assert future.get().batch["x"].tolist() == [0, 10, 21], future.get().batch["x"]
ray.shutdown()
print("SCENARIO OK")
