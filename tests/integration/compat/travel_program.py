"""Handles and refs that travel, and awaited refs: a Ray program run under ``podium run``.

Plain ``import ray``. Prints one ``name: value`` line per check (test_travel.py reads them) and
``PROGRAM OK`` at the end. Run it with real Ray to compare: ``python travel_program.py``.
"""

import asyncio
import dataclasses
import os
import time

import ray


@ray.remote
class Store:
    def __init__(self):
        self.items = {}

    def set(self, key, value):
        self.items[key] = value
        return True

    def get(self, key):
        return self.items[key]

    def pid(self):
        return os.getpid()


@dataclasses.dataclass
class Holder:
    handle: object
    note: str = "held"


@ray.remote
class User:
    """Gets handles in its constructor (a list, a dict), in arguments (a dataclass), and refs
    nested in arguments; hands refs and handles back in results."""

    def __init__(self, stores, config):
        self.stores = stores
        self.primary = config["primary"]

    def write(self, key, value):
        return ray.get([s.set.remote(key, value) for s in self.stores])

    def read_through(self, holder):
        return ray.get(holder.handle.get.remote("a"))

    def kinds(self, box):
        return sorted({str(isinstance(r, ray.ObjectRef)) for r in box["refs"]})

    def total(self, box):
        return sum(ray.get(box["refs"]))

    def make_refs(self):
        return [ray.put(10), self.primary.get.remote("a")]

    def primary_handle(self):
        return {"store": self.primary}

    def call_gone(self, holder):
        try:
            ray.get(holder.handle.get.remote("a"))
        except ray.exceptions.ActorDiedError as exc:
            return f"ActorDiedError: {exc}"
        return "no error"


@ray.remote
class Slow:
    async def nap(self, seconds):
        await asyncio.sleep(seconds)
        return seconds

    def boom(self):
        raise ValueError("boom in Slow")


@ray.remote
class Waiter:
    def __init__(self, slow):
        self.slow = slow

    async def wait_for_slow(self, seconds):
        return await self.slow.nap.remote(seconds)

    async def ping(self):
        return "pong"

    async def gathered(self):
        return await asyncio.gather(*[self.slow.nap.remote(0.05) for _ in range(4)])

    async def bounded(self):
        try:
            await asyncio.wait_for(self.slow.nap.remote(5), 0.3)
        except asyncio.TimeoutError:
            return "timeout"
        return "no timeout"

    async def failing(self):
        try:
            await self.slow.boom.remote()
        except ray.exceptions.RayTaskError as exc:
            return type(exc).__name__
        return "no error"


@ray.remote
class Owner:
    def make(self):
        return [ray.put(list(range(5)))]


@ray.remote
def add_task(box):
    return sum(ray.get(box["refs"]))


async def driver_awaits(slow):
    out = {}
    out["await"] = await slow.nap.remote(0.05)
    out["gather"] = await asyncio.gather(*[slow.nap.remote(0.02) for _ in range(3)])
    try:
        await asyncio.wait_for(slow.nap.remote(5), 0.3)
        out["wait_for"] = "no timeout"
    except asyncio.TimeoutError:
        out["wait_for"] = "timeout"
    out["future"] = slow.nap.remote(0.01).future().result()
    out["wrap_future"] = await asyncio.wrap_future(slow.nap.remote(0.01).future())
    out["await put"] = await ray.put(7)
    try:
        await slow.boom.remote()
        out["await error"] = "no error"
    except ray.exceptions.RayTaskError as exc:
        out["await error"] = f"{type(exc).__name__} {'boom in Slow' in str(exc)}"
    return out


def on(i):
    """Options that pin an actor to the i-th live node (all on one node when there is one)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False)}


def main():
    ray.init()
    stores = [Store.options(**on(0)).remote(), Store.options(**on(1)).remote()]
    user = User.options(**on(1)).remote(stores, {"primary": stores[0]})
    print("write:", ray.get(user.write.remote("a", 5)))
    print("read through dataclass:", ray.get(user.read_through.remote(Holder(stores[1]))))
    put_ref = ray.put(3)
    call_ref = stores[0].get.remote("a")
    print("nested kinds:", ray.get(user.kinds.remote({"refs": [put_ref, call_ref]})))
    print("nested total:", ray.get(user.total.remote({"refs": [put_ref, call_ref]})))
    print("nested to a task:", ray.get(add_task.remote({"refs": [put_ref, stores[1].get.remote("a")]})))
    made = ray.get(user.make_refs.remote())
    print("refs from a result:", ray.get(made))
    back = ray.get(user.primary_handle.remote())["store"]
    print("handle from a result:", ray.get(back.get.remote("a")), ray.get(back.pid.remote()) == ray.get(stores[0].pid.remote()))

    slow = Slow.options(**on(0)).remote()
    waiter = Waiter.options(**on(1)).remote(slow)
    long_call = waiter.wait_for_slow.remote(2.0)
    pong = waiter.ping.remote()
    ray.wait([pong], timeout=30)
    still, _ = ray.wait([long_call], timeout=0)
    print("ping while awaiting:", ray.get(pong), "long call done" if still else "long call running")
    print("awaited in actor:", ray.get(long_call))
    print("gather in actor:", ray.get(waiter.gathered.remote()))
    print("wait_for in actor:", ray.get(waiter.bounded.remote()))
    print("error awaited in actor:", ray.get(waiter.failing.remote()))
    for key, value in asyncio.run(driver_awaits(slow)).items():
        print(f"driver {key}:", value)

    doomed = Store.options(**on(0)).remote()
    ray.get(doomed.set.remote("a", 1))
    keeper = User.options(**on(1)).remote([doomed], {"primary": doomed})
    ray.get(keeper.write.remote("b", 2))  # the borrowed handle is attached
    ray.kill(doomed)
    time.sleep(1.0)
    print("borrowed handle of a dead actor:", ray.get(keeper.call_gone.remote(Holder(doomed))))

    owner = Owner.options(**on(1)).remote()
    owned = ray.get(owner.make.remote())[0]
    print("owner alive:", ray.get(owned))
    ray.kill(owner)
    time.sleep(1.0)
    try:
        ray.get(owned)
        print("owner dead: no error")
    except ray.exceptions.OwnerDiedError as exc:
        print("owner dead:", type(exc).__name__)
    print("PROGRAM OK")


if __name__ == "__main__":
    main()
