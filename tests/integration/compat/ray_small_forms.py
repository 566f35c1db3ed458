"""Run under ``podium run --num-cpus 6 --num-gpus 1``: the small Ray forms verl, SkyRL and
OpenRLHF use, with plain ``import ray``. Prints ``SMALL FORMS OK`` last."""

from __future__ import annotations

import asyncio
import inspect
import sys
import types
import unittest.mock

import ray

assert ray.__podium__
assert not ray.is_initialized()  # the driver has not joined yet, as in Ray


@ray.remote(resources={})
def in_a_task() -> tuple:
    import ray as ray_there
    from ray._private.services import get_node_ip_address

    return ray_there.is_initialized(), get_node_ip_address(), ray_there.util.get_node_ip_address()


# The first Ray call without ray.init starts the embedded cluster podium run sized.
initialized, ip, util_ip = ray.get(in_a_task.remote())
assert initialized is True, "ray.is_initialized() is False in a task"
assert ip == util_ip and ip, (ip, util_ip)
resources = ray.cluster_resources()
assert resources["CPU"] == 6.0 and resources["GPU"] == 1.0, resources
assert ray.is_initialized()
assert ray._private.services.get_node_ip_address()  # in the driver too


@ray.remote
class AsyncInit:
    """An actor whose constructor is ``async def`` (OpenRLHF's form)."""

    async def __init__(self, start: int) -> None:
        await asyncio.sleep(0)
        self.value = start
        self.loop_id = id(asyncio.get_running_loop())
        self.ticks = 0
        self.ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while self.ticks < 3:
            self.ticks += 1
            await asyncio.sleep(0)

    async def same_loop(self) -> bool:
        await self.ticker  # a task __init__ started runs on the loop that serves the methods
        return id(asyncio.get_running_loop()) == self.loop_id and self.ticks == 3

    def get(self) -> int:
        return self.value

    def initialized(self) -> bool:
        return ray.is_initialized()


plain = AsyncInit.options(resources=None).remote(5)
assert ray.get(plain.get.remote()) == 5
assert ray.get(plain.same_loop.remote()) is True
assert ray.get(plain.initialized.remote()) is True
threaded = AsyncInit.options(max_concurrency=4, resources={}, num_cpus=1).remote(7)
assert ray.get(threaded.get.remote()) == 7 and ray.get(threaded.same_loop.remote()) is True


@ray.remote
class Broken:
    async def __init__(self) -> None:
        raise ValueError("no model here")

    def ping(self) -> int:
        return 1


try:
    ray.get(Broken.remote().ping.remote())
except Exception as exc:  # noqa: BLE001 - the constructor's error reaches the caller
    assert "no model here" in str(exc), exc
else:
    raise AssertionError("an async __init__ that raised built an actor")

# A name the stand-in does not provide is absent to hasattr/getattr and to mock's probes,
# and its message still names the Podium alternative.
assert not hasattr(ray, "data") and getattr(ray, "tune", "absent") == "absent"
assert getattr(ray, "_is_coroutine_marker", None) is None  # Python 3.12's mock probes it
assert not inspect.iscoroutinefunction(ray)
try:
    ray.serve
except NotImplementedError as exc:
    assert "on Podium use" in str(exc) and isinstance(exc, AttributeError), exc
try:
    from ray import data  # noqa: F401
except ImportError as exc:
    assert "on Podium use" in str(exc), exc
else:
    raise AssertionError("from ray import data worked")
holder = types.ModuleType("uses_ray")
holder.ray = ray
sys.modules["uses_ray"] = holder
with unittest.mock.patch("uses_ray.ray") as fake:
    fake.get.return_value = 42
    assert holder.ray.get("anything") == 42
assert holder.ray is ray
with unittest.mock.patch("uses_ray.ray", autospec=True) as spec:
    assert not hasattr(spec, "data")
with unittest.mock.patch.object(ray, "get", new=unittest.mock.AsyncMock(return_value=3)):
    assert asyncio.run(ray.get("x")) == 3

ray.kill(plain)
ray.kill(threaded)
print("SMALL FORMS OK")
