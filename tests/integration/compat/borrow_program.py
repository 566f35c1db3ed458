"""Refs kept by processes other than their owner (Ray's borrowers), under ``podium run``:
prints ``name: value`` lines for test_travel.py and ``PROGRAM OK``."""

import gc
import time

import ray


@ray.remote
class Keeper:
    def keep(self, box):
        self.box = box
        return True

    def read(self):
        return ray.get(self.box["ref"])

    def pass_to(self, other):
        kept = ray.get(other.keep.remote({"ref": self.box["ref"]}))
        self.box = None  # this borrower drops its copy: the other one holds the value now
        return kept

    def forget(self):
        self.box = None
        return True

    def make(self):
        self.mine = ray.put(list(range(3)))
        return [self.mine]

    def drop_mine(self):
        self.mine = None
        return True


@ray.remote
class Holder:
    def __init__(self, box):
        self.box = box

    def read(self):
        return ray.get(self.box["ref"])


def store():
    from podium.controller.session.runtime import get_runtime
    return get_runtime().objects.store


def until(condition):
    """Wait for ``condition()`` (the owner hears of a release or a death in its own time)."""
    deadline = time.monotonic() + 60
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def lend(keeper, value):
    """Put ``value``, hand its ref (nested: it arrives as a ref) to ``keeper``, drop ours."""
    ref = ray.put(value)
    object_id = ref.object_id
    assert ray.get(keeper.keep.remote({"ref": ref}))
    del ref
    gc.collect()
    return object_id


def main():
    ray.init()
    a, b, c = Keeper.remote(), Keeper.remote(), Keeper.remote()
    warm = ray.put(0)  # starts the object store; the baseline counts it
    baseline = store().held_count

    object_id = lend(a, {"weights": 42})
    print("kept for its borrower:", until(lambda: store().kept_for_borrowers(object_id)))
    print("borrower reads:", ray.get(a.read.remote()))
    print("passed on:", ray.get(a.pass_to.remote(b)))
    print("second borrower reads:", ray.get(b.read.remote()), store().holds(object_id))
    ray.get(b.forget.remote())
    print("freed with its last borrow:", until(lambda: not store().holds(object_id)),
          store().held_count == baseline)

    object_id = lend(c, "kept by a borrower that dies")
    print("kept for the doomed borrower:", until(lambda: store().kept_for_borrowers(object_id)))
    ray.kill(c)
    print("freed when its borrower died:", until(lambda: not store().holds(object_id)),
          store().held_count == baseline)

    # A ref in an actor's constructor arguments, dropped here while the actor is still starting.
    holder = Holder.remote({"ref": ray.put("given to a constructor")})
    gc.collect()
    print("kept by a constructor:", ray.get(holder.read.remote()))

    theirs = ray.get(a.make.remote())[0]
    ray.get(a.drop_mine.remote())
    print("borrowed from a worker:", ray.get(theirs))
    del warm
    print("PROGRAM OK")


if __name__ == "__main__":
    main()
