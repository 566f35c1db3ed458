"""``ray.util.ActorPool``: spread calls over a fixed set of actors, one call per actor at a
time, and read the results in submission order or as they finish.

Ray 2.x's API: ``map``/``map_unordered`` (generators of results), ``submit`` (queued while
every actor is busy), ``get_next`` (submission order) / ``get_next_unordered`` (first
finished), ``has_next``, ``has_free``, ``pop_idle``, ``push``. ``fn(actor, value)`` must
return a ref (``actor.method.remote(value)``). A result that is not there within ``timeout``
raises ``TimeoutError`` (Podium's DeadlineExceededError); with ``ignore_if_timedout=True`` the
pending call is dropped from the pool first (its actor is free again).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Iterator

from podium.errors import DeadlineExceededError, InvalidArgumentError

__all__ = ["ActorPool"]


class ActorPool:
    """Ray's ``ray.util.ActorPool`` over ``actors`` (see the module docstring)."""

    def __init__(self, actors: list) -> None:
        self._idle: list = list(actors)
        #: ref (or tuple of refs) -> (submission index, actor), for the calls in flight.
        self._running: dict[Any, tuple[int, Any]] = {}
        #: submission index -> ref, for the calls not read yet.
        self._by_index: dict[int, Any] = {}
        self._next_index = 0
        self._next_to_return = 0
        #: (fn, value) submitted while no actor was idle, in order.
        self._waiting: deque[tuple[Callable, Any]] = deque()

    # ------------------------------------------------------------------ submitting

    def submit(self, fn: Callable[[Any, Any], Any], value: Any) -> None:
        """Run ``fn(actor, value)`` on an idle actor, or once one is free."""
        if not self._idle:
            self._waiting.append((fn, value))
            return
        actor = self._idle.pop()
        ref = fn(actor, value)
        self._running[_key(ref)] = (self._next_index, actor)
        self._by_index[self._next_index] = ref
        self._next_index += 1

    def map(self, fn: Callable[[Any, Any], Any], values: Iterable) -> Iterator:
        """Submit ``fn`` over ``values``; the results, in the order of ``values``. Results
        of earlier submissions not read yet are dropped first."""
        self._drop_unread()
        for value in values:
            self.submit(fn, value)
        return self._results(self.get_next)

    def map_unordered(self, fn: Callable[[Any, Any], Any], values: Iterable) -> Iterator:
        """Submit ``fn`` over ``values``; the results as they finish."""
        self._drop_unread()
        for value in values:
            self.submit(fn, value)
        return self._results(self.get_next_unordered)

    def _results(self, next_result: Callable[[], Any]) -> Iterator:
        while self.has_next():
            yield next_result()

    def _drop_unread(self) -> None:
        while self.has_next():
            try:
                self.get_next(timeout=0, ignore_if_timedout=True)
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ reading

    def has_next(self) -> bool:
        """Whether a submitted call's result is still to be read."""
        return bool(self._running)

    def get_next(self, timeout: float | None = None, ignore_if_timedout: bool = False) -> Any:
        """The result of the oldest unread submission (waits up to ``timeout`` s)."""
        from podium.compat.ray import get, wait

        if not self.has_next():
            raise StopIteration("No more results to get")
        if self._next_to_return >= self._next_index:
            raise InvalidArgumentError("get_next() cannot follow get_next_unordered() for the same submissions")
        index = self._next_to_return
        ref = self._by_index[index]
        late = timeout is not None and not wait(_refs(ref), num_returns=len(_refs(ref)), timeout=timeout)[0]
        if late and not ignore_if_timedout:
            raise DeadlineExceededError(f"Timed out waiting for result ({timeout} s)")
        del self._by_index[index]
        self._next_to_return += 1
        self._release(ref)
        if late:
            raise DeadlineExceededError(f"Timed out waiting for result ({timeout} s); the task was dropped")
        return get(ref)

    def get_next_unordered(self, timeout: float | None = None, ignore_if_timedout: bool = False) -> Any:
        """The result of whichever unread submission finishes first (waits up to ``timeout`` s)."""
        from podium.compat.ray import get, wait

        if not self.has_next():
            raise StopIteration("No more results to get")
        refs = [r for key in self._running for r in _refs(key)]
        ready = wait(refs, num_returns=1, timeout=timeout)[0]
        if not ready:
            raise DeadlineExceededError(f"Timed out waiting for result ({timeout} s)"
                                        + ("; nothing was dropped" if ignore_if_timedout else ""))
        key = next(k for k in self._running if ready[0] in _refs(k))
        index, _ = self._running[key]
        ref = self._by_index.pop(index)
        self._next_to_return = max(self._next_to_return, index + 1)
        self._release(ref)
        return get(ref)

    def _release(self, ref: Any) -> None:
        """The call of ``ref`` is read (or dropped): its actor takes the next waiting submission."""
        _, actor = self._running.pop(_key(ref))
        self._idle.append(actor)
        if self._waiting:
            self.submit(*self._waiting.popleft())

    # ------------------------------------------------------------------ actors

    def has_free(self) -> bool:
        """Whether an actor is idle and no submission waits for one."""
        return bool(self._idle) and not self._waiting

    def pop_idle(self) -> Any:
        """Take an idle actor out of the pool (None when there is none free)."""
        return self._idle.pop() if self.has_free() else None

    def push(self, actor: Any) -> None:
        """Add ``actor`` to the pool (it takes a waiting submission at once)."""
        busy = [a for _, a in self._running.values()]
        if any(actor is a for a in (*self._idle, *busy)):
            raise InvalidArgumentError("Actor already belongs to current ActorPool")
        self._idle.append(actor)
        if self._waiting:
            self.submit(*self._waiting.popleft())


def _key(ref: Any) -> Any:
    """A dict key for what ``fn`` returned (a list of refs becomes a tuple)."""
    return tuple(ref) if isinstance(ref, list) else ref


def _refs(ref: Any) -> list:
    return list(ref) if isinstance(ref, (list, tuple)) else [ref]
