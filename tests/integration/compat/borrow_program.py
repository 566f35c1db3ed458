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

    def forget_inner(self):
        self.inner = None
        return True

    def make(self):
        self.mine = ray.put(list(range(3)))
        return [self.mine]

    def drop_mine(self):
        self.mine = None
        return True

    def read_nested(self):
        """The value of the ref inside the put value this actor keeps."""
        return ray.get(ray.get(self.box["ref"])["r"])

    def keep_inner(self):
        """Keep the ref found inside the put value (a borrow of its own), not the put value."""
        self.inner = ray.get(self.box["ref"])["r"]
        self.box = None
        return True

    def read_inner(self):
        return ray.get(self.inner)

    def nest_here(self):
        """Put a value, put another holding its ref, drop the first: this worker's own store."""
        from podium.worker.host import object_store

        baseline = object_store().held_count
        self.outer = ray.put({"r": ray.put("inner put by a worker")})
        gc.collect()
        value = ray.get(ray.get(self.outer)["r"])
        self.outer = None
        gc.collect()
        return value, until(lambda: object_store().held_count == baseline)


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

    # A ref inside a put value keeps its value alive as long as the put value lives anywhere.
    baseline = store().held_count  # (the holder keeps its constructor's value)
    inner = ray.put("inner value")
    inner_id = inner.object_id
    outer = ray.put({"r": inner})
    control = ray.put("dropped with it")
    control_id = control.object_id
    del inner, control
    gc.collect()
    # Both releases go through one queue: once the control value is gone, so would inner be.
    print("kept by the value holding it:", until(lambda: not store().holds(control_id)), store().holds(inner_id))
    print("read through the outer value here:", ray.get(ray.get(outer)["r"]))
    outer_id = outer.object_id
    assert ray.get(a.keep.remote({"ref": outer}))
    del outer
    gc.collect()
    print("outer kept for its borrower:", until(lambda: store().kept_for_borrowers(outer_id)),
          store().holds(inner_id))
    print("borrower reads the nested ref:", ray.get(a.read_nested.remote()))
    ray.get(a.forget.remote())
    print("freed with the outer value:", until(lambda: not store().holds(outer_id) and not store().holds(inner_id)),
          store().held_count == baseline)

    inner = ray.put("inner kept alone")
    inner_id = inner.object_id
    outer = ray.put({"r": inner})
    outer_id = outer.object_id
    del inner
    assert ray.get(a.keep.remote({"ref": outer}))
    print("nested ref kept alone:", ray.get(a.keep_inner.remote()))
    del outer
    gc.collect()
    print("outer freed, inner borrowed:", until(lambda: not store().holds(outer_id)), store().holds(inner_id),
          ray.get(a.read_inner.remote()))
    ray.get(a.forget_inner.remote())
    print("inner freed with its borrow:", until(lambda: not store().holds(inner_id)),
          store().held_count == baseline)
    print("nested in a worker's store:", ray.get(a.nest_here.remote()))

    theirs = ray.get(a.make.remote())[0]
    ray.get(a.drop_mine.remote())
    print("borrowed from a worker:", ray.get(theirs))
    del warm
    print("PROGRAM OK")


if __name__ == "__main__":
    main()
