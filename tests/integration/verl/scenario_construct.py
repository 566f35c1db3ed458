"""Under `podium run` (Ray mode): an actor is constructed while `.remote()` returns, as in
Ray. verl's RayWorkerGroup creates its workers one at a time; workers that join
torch.distributed in `__init__` (verl's FSDP workers do) wait there for ranks created after
them. Calls made meanwhile wait for the constructor; a constructor's error is their error."""

import time

import ray
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl_workers import Joined

ray.init()
wg = RayWorkerGroup(RayResourcePool([2], max_colocate_count=1), RayClassWithInitArgs(cls=ray.remote(Joined)))
assert wg.total() == [3.0, 3.0]


@ray.remote
class Slow:
    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)
        self.calls: list[int] = []

    def note(self, i: int) -> list[int]:
        self.calls.append(i)
        return list(self.calls)


started = time.monotonic()
slow = Slow.remote(2.0)
assert time.monotonic() - started < 2.0  # returned while the constructor sleeps
refs = [slow.note.remote(i) for i in range(5)]  # queued behind the constructor, in order
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
