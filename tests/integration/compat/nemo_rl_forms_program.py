"""Run under ``podium run --num-cpus 2``: Ray forms NeMo-RL's GRPO entry point uses that the
stand-in gained for it (issue #49 item 12), with plain ``import ray``. Prints ``NEMO FORMS OK``
last.

- ``ray.scripts.scripts.memory_summary(stats_only=True, num_entries=5)``, which NeMo-RL's driver
  memory tracker (nemo_rl/utils/memory_tracker.py) imports at module level and logs: the values
  this process holds, in the driver and in an actor.
- ``num_cpus=0`` actors and tasks (NeMo-RL's ``IsolatedWorkerInitializer`` is
  ``.options(num_cpus=0)``): they start, from the driver and from inside an actor, and each
  reserves only the least CPU share, so more of them run than the cluster has CPUs.
- a ``@staticmethod`` read through ``ray.remote(Cls)`` comes back unbound (NeMo-RL calls
  ``worker_class.configure_worker(num_gpus=..., ...)`` on the actor class); a regular method
  comes back bound, a classmethod bound to the class.
"""

from __future__ import annotations

import re

import ray
from ray.scripts.scripts import memory_summary

MIB = 1 << 20


def held(summary: str) -> tuple[int, float]:
    """(objects, size) read back from a summary's "Held values" line."""
    match = re.search(r"Held values: (\d+) objects, ([\d.]+) ", summary)
    assert match, summary
    return int(match.group(1)), float(match.group(2))


ray.init()
count0, _ = held(memory_summary(stats_only=True, num_entries=5))
ref = ray.put(b"x" * (4 * MIB))
count1, size_mb = held(memory_summary(stats_only=True, units="MB"))
assert count1 == count0 + 1 and size_mb >= 4.0, (count0, count1, size_mb)
del ref
import gc  # noqa: E402 - the ref's release is what is measured

gc.collect()
count2 = count0
for _ in range(200):  # the release travels to the store on its loop
    count2, _ = held(memory_summary(stats_only=True))
    if count2 == count0:
        break
    import time

    time.sleep(0.05)
assert count2 == count0, (count0, count2)


@ray.remote(num_cpus=1)
class Holder:
    """Puts a value in its own store and summarises that store."""

    def put_and_summarise(self) -> tuple[str, object]:
        from ray.scripts.scripts import memory_summary as there

        self.kept = ray.put(b"y" * (2 * MIB))
        return there(stats_only=True, units="KB"), self.kept


holder = Holder.remote()
text, _kept = ray.get(holder.put_and_summarise.remote())
count, size_kb = held(text)
assert count >= 1 and size_kb >= 2048, text

try:
    memory_summary()  # Ray's per-object table
except NotImplementedError as exc:
    assert "podium status" in str(exc) and "stats_only=True" in str(exc), exc
else:
    raise AssertionError("memory_summary(stats_only=False) must be refused")
for bad in ({"units": "TB"}, {"address": "10.0.0.1:6379"}, {"num_entries": -1}, {"sort_by": "NAME"}):
    try:
        memory_summary(stats_only=True, **bad)
    except ValueError as exc:
        assert str(next(iter(bad.values()))) in str(exc), exc
    else:
        raise AssertionError(f"memory_summary({bad}) must be refused")


@ray.remote
class Zero:
    """Asks for nothing."""

    def pid(self) -> int:
        import os

        return os.getpid()

    def spawn(self, n: int) -> list[int]:
        """Starts ``n`` 0-CPU actors from inside this one, as NeMo-RL's initializer does."""
        inner = [Zero.options(num_cpus=0).remote() for _ in range(n)]
        return ray.get([z.pid.remote() for z in inner])


@ray.remote(num_cpus=0)
def zero_task() -> str:
    return "ran"


# The cluster has 2 CPUs: 4 actors that asked for 1 would wait; these reserve 1/1000 each.
zeros = [Zero.options(num_cpus=0).remote() for _ in range(4)]
assert len(set(ray.get([z.pid.remote() for z in zeros], timeout=120))) == 4
assert len(set(ray.get(zeros[0].spawn.remote(2), timeout=120))) == 2
assert ray.get(zero_task.remote(), timeout=120) == "ran"
available = ray.available_resources().get("CPU", 0)
# Of 2 CPUs, the Holder above keeps 1; 6 zero-resource actors and a task worker hold 7/1000.
assert 0.98 < available < 1.0, available


class Worker:
    """A class with the three kinds of method NeMo-RL's worker classes have."""

    @staticmethod
    def configure_worker(num_gpus: float, bundle_indices=None) -> tuple:
        return ({"num_gpus": num_gpus}, bundle_indices)

    @classmethod
    def kind(cls) -> str:
        return cls.__name__

    def method(self) -> str:
        return "bound"


WorkerActor = ray.remote(Worker)
assert WorkerActor.configure_worker(num_gpus=0.5, bundle_indices=(0, [0])) == ({"num_gpus": 0.5}, (0, [0]))
assert WorkerActor.configure_worker(1) == ({"num_gpus": 1}, None)
assert WorkerActor.kind() == "Worker"
assert WorkerActor.method.__self__ is WorkerActor  # bound, as Ray's ActorClass (a subclass instance) gives it
print("NEMO FORMS OK")
