"""Run under ``podium run --num-cpus 2``: Ray forms NeMo-RL's GRPO entry point uses that the
stand-in gained for it (issue #49 item 12), with plain ``import ray``. Prints ``NEMO FORMS OK``
last.

- ``ray.scripts.scripts.memory_summary(stats_only=True, num_entries=5)``, which NeMo-RL's driver
  memory tracker (nemo_rl/utils/memory_tracker.py) imports at module level and logs: the values
  this process holds, in the driver and in an actor.
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
print("NEMO FORMS OK")
