"""Run under ``podium run --num-cpus 8``: ``num_returns=N`` on tasks and actor methods with
plain ``import ray``. Prints ``NUM RETURNS OK`` last."""

from __future__ import annotations

import ray

ray.init()


@ray.remote(num_returns=3)
def three(x: int) -> tuple:
    return x, x + 1, x + 2


@ray.remote
def add(a: int, b: int) -> int:
    return a + b


@ray.remote
class Pair:
    @ray.method(num_returns=2)
    def split(self, x: int) -> tuple:
        return x, -x

    def both(self, x: int) -> list:
        return [x, x * 10]

    def wrong(self) -> tuple:
        return 1, 2, 3

    def fails(self) -> tuple:
        raise ValueError("no pair")

    def relay(self, other) -> list:  # a handle passed to another process keeps ray.method's count
        first, second = other.split.remote(7)
        return ray.get([first, second])


a, b, c = three.remote(1)
assert ray.get([a, b, c]) == [1, 2, 3]
assert ray.get(add.remote(b, c)) == 5  # each ref is an argument like any other
ready, _ = ray.wait([a, b, c], num_returns=3)
assert len(ready) == 3
assert ray.get(list(three.options(num_returns=3).remote(5))) == [5, 6, 7]

pair = Pair.remote()
x, y = pair.split.remote(4)
assert ray.get(x) == 4 and ray.get(y) == -4
p, q = pair.both.options(num_returns=2).remote(3)
assert ray.get([p, q]) == [3, 30]
assert ray.get(Pair.remote().relay.remote(pair)) == [7, -7]

for refs, text in ((pair.wrong.options(num_returns=2).remote(), "num_returns=2 but returned a tuple of 3"),
                   (pair.fails.options(num_returns=2).remote(), "no pair")):
    for ref in refs:
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the text is checked
            assert text in str(exc), str(exc)
        else:
            raise AssertionError(f"{text!r} was not raised")
for bad in (0, -1, 2000, "dynamic", 1.5):
    try:
        three.options(num_returns=bad)
    except (ValueError, NotImplementedError):
        pass
    else:
        raise AssertionError(f"num_returns={bad!r} was accepted")
# Ray's timeout=0: a finished call's value, no wait (vLLM's _wait_until_pg_ready does this).
ready_ref = ray.util.placement_group([{"CPU": 1}]).ready()
ray.wait([ready_ref])
assert ray.get(ready_ref, timeout=0) is True
done = add.remote(1, 2)
ray.wait([done])
assert ray.get(done, timeout=0) == 3 and ray.get([done], timeout=0) == [3]
from ray.types import ObjectRef  # noqa: E402 - vLLM's Ray executor imports it
assert isinstance(done, ObjectRef)
print("NUM RETURNS OK")
