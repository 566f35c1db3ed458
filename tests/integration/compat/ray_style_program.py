"""A small program written for Ray, run unchanged on Podium but for its first import.

It joins the cluster named by the environment (``ray.init(address="auto")``), and prints
one ``name: value`` line per check for test_ray_program.py to read.
"""

import gc
import subprocess
import sys
import time

import podium.compat.ray as ray
import torch

from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.worker import Dispatch, Worker, register


@ray.remote
class Counter:
    def __init__(self):
        self.value = 0

    def incr(self, by=1):
        self.value += by
        return self.value


@ray.remote
def square(x):
    return x * x


class Summer(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def total(self, tensors):
        return sum(float(t.sum()) for t in tensors)


def main():
    ray.init(address="auto")
    counter = Counter.options(name="counter", num_cpus=1).remote()
    ray.get([counter.incr.remote() for _ in range(5)])
    print("counter:", ray.get(counter.incr.remote(10)))

    print("squares:", sum(ray.get([square.remote(i) for i in range(20)])))

    refs = [ray.put(torch.full((1000,), float(i))) for i in range(3)]
    ready, _ = ray.wait(refs, num_returns=3, timeout=60)
    wg = WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(Summer))
    print("group sums:", wg.total(ray.get(ready)), wg.total(refs[2]))

    lookup = ("import podium.compat.ray as ray; ray.init(address='auto'); "
              "c = ray.get_actor('counter'); print(ray.get(c.incr.remote(100)))")
    other = subprocess.run([sys.executable, "-c", lookup], capture_output=True, text=True, timeout=120)
    print("second controller:", other.stdout.strip() or other.stderr[-2000:])

    free = ray.available_resources()["CPU"]
    big = Counter.options(num_cpus=4).remote()
    ray.get(big.incr.remote())
    print("cpus taken:", free - ray.available_resources()["CPU"])
    del big
    deadline = time.monotonic() + 30
    while ray.available_resources()["CPU"] != free and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    print("cpus back:", ray.available_resources()["CPU"] == free)

    ray.kill(counter)
    try:
        ray.get_actor("counter")
    except ValueError:
        print("after kill: gone")
    try:
        ray.data
    except NotImplementedError as exc:
        print("unsupported:", exc)
    ray.shutdown()


if __name__ == "__main__":
    main()
