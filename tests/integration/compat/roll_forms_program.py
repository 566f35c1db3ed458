"""Run under ``podium run --num-cpus 4``: the small Ray internals ROLL imports, with plain
``import ray``: ``ray.util.timer._Timer`` (its pipeline's step timers),
``ray._private.async_compat.has_async_methods`` on ``ActorClass.__ray_metadata__.modified_class``
(how its ``Cluster`` picks an actor's ``max_concurrency``), ``ray._private.profiling.profile``
(spans in ``ray.timeline()``, from the driver and from an actor) and
``ray._private.worker.RemoteFunctionNoArgs`` in an annotation. Prints ``ROLL FORMS OK`` last."""

from __future__ import annotations

import asyncio
import time
from typing import Type, Union

import ray
from ray._private import profiling
from ray._private.async_compat import has_async_methods
from ray._private.worker import RemoteFunctionNoArgs
from ray.util.timer import _Timer


class Plain:
    """A sync worker."""

    def step(self) -> int:
        with profiling.profile("offload_states"):
            time.sleep(0.01)
        return 1


class Async:
    """An async worker."""

    async def generate(self) -> int:
        await asyncio.sleep(0)
        return 2


WorkerType = Union[RemoteFunctionNoArgs[Plain], Type[Plain], str]  # ROLL's Cluster annotation
assert WorkerType is not None

ray.init()
plain_cls, async_cls = ray.remote(Plain), ray.remote(Async)
assert plain_cls.__ray_metadata__.modified_class is Plain and plain_cls.__ray_metadata__.class_name == "Plain"
assert not has_async_methods(plain_cls.__ray_metadata__.modified_class)
assert has_async_methods(async_cls.__ray_metadata__.modified_class)
# ROLL: an async worker gets max_concurrency 1000, a sync one 1.
plain = plain_cls.options(max_concurrency=1).remote()
slow = async_cls.options(max_concurrency=1000).remote()
assert ray.get(slow.generate.remote()) == 2

timer = _Timer(window_size=2)
for n in (4, 6, 8):
    with timer, profiling.profile("load_states", extra_data={"name": "driver_step"}):
        assert ray.get(plain.step.remote()) == 1
    timer.push_units_processed(n)
assert timer.count == 3 and timer.has_units_processed() and timer.mean > 0
assert timer.mean_units_processed == 7.0 and timer.mean_throughput > 0
try:
    profiling.profile("x", extra_data={"cname": "red"}).__enter__()
    raise AssertionError("extra_data it cannot keep was accepted")
except ValueError as exc:
    assert "cname" in str(exc)

events = ray.timeline()
profiled = {(e["name"], e["pid"] == events[0]["pid"]) for e in events if e.get("cat") == "profile"}
assert ("driver_step", True) in profiled, profiled  # the driver's lane
assert ("offload_states", False) in profiled, profiled  # the actor's lane
print("ROLL FORMS OK")
