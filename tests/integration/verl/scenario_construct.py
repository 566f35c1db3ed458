"""Under `podium run` (Ray mode): an actor is constructed while `.remote()` returns, as in
Ray. verl's RayWorkerGroup creates its workers one at a time; workers that join
torch.distributed in `__init__` (verl's FSDP workers do) wait there for ranks created after
them. Calls made meanwhile wait for the constructor; a constructor's error is their error."""

import os
import tempfile
import time

import ray
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl_workers import Joined

ray.init()
wg = RayWorkerGroup(RayResourcePool([2], max_colocate_count=1), RayClassWithInitArgs(cls=ray.remote(Joined)))
assert wg.total() == [3.0, 3.0]


@ray.remote
class Gated:
    def __init__(self, gate: str) -> None:
        # The driver writes the gate only once .remote() has returned: a .remote() that waited
        # for this constructor would leave it here until the deadline, and it would fail.
        deadline = time.monotonic() + 60
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise RuntimeError(".remote() waited for the constructor: the gate never came")
            time.sleep(0.01)
        self.calls: list[int] = []

    def note(self, i: int) -> list[int]:
        self.calls.append(i)
        return list(self.calls)


gate = os.path.join(tempfile.mkdtemp(), "gate")
gated = Gated.remote(gate)  # returns while the constructor waits for the gate
refs = [gated.note.remote(i) for i in range(5)]  # queued behind the constructor, in order
open(gate, "w").close()
assert ray.get(refs[-1]) == [0, 1, 2, 3, 4]


@ray.remote
class Broken:
    def __init__(self) -> None:
        raise ValueError("constructor failed on purpose")

    def ping(self) -> int:
        return 1


broken = Broken.remote()
for attempt in range(2):  # a call made before it failed, and one made after
    try:
        ray.get(broken.ping.remote())
    except ray.exceptions.RayError as exc:  # RemoteError (Ray raises RayActorError)
        assert "constructor failed on purpose" in str(exc), exc
    else:
        raise AssertionError("a call to an actor whose constructor failed succeeded")
    time.sleep(1.0)
ray.shutdown()
print("SCENARIO OK")
