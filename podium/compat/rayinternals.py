"""Small Ray internals that ROLL imports, as Ray defines them: ``ray.util.timer._Timer``,
``ray._private.async_compat`` (``is_async_func``, ``has_async_methods``),
``ray._private.profiling.profile`` (a span in Podium's timeline) and
``ray._private.worker.RemoteFunctionNoArgs`` (a typing generic)."""

from __future__ import annotations

import contextlib
import inspect
import time
from functools import lru_cache
from typing import Any, Generic, Iterator, TypeVar

from podium.errors import InvalidArgumentError
from podium.tracering import RING, now_ns

__all__ = ["RemoteFunctionNoArgs", "has_async_methods", "is_async_func", "profile", "Timer"]

R = TypeVar("R")
#: Ray's bound on ``_Timer``'s window is none; Podium's keeps it sane.
MAX_WINDOW = 1_000_000


class Timer:
    """Ray's ``_Timer``: the duration of a block (``with timer:``) over the last
    ``window_size`` samples, with units processed for a throughput. Not thread-safe (Ray's
    neither)."""

    def __init__(self, window_size: int = 10) -> None:
        if not 1 <= window_size <= MAX_WINDOW:
            raise InvalidArgumentError(f"window_size must be in [1, {MAX_WINDOW}], not {window_size}")
        self._window_size = window_size
        self._samples: list[float] = []
        self._units_processed: list[float] = []
        self._start_time: float | None = None
        self._total_time = 0.0
        self.count = 0

    def __enter__(self) -> None:
        if self._start_time is not None:
            raise InvalidArgumentError("_Timer: concurrent updates are not supported")
        self._start_time = time.time()

    def __exit__(self, *exc: Any) -> None:
        started, self._start_time = self._start_time, None
        self.push(time.time() - (started if started is not None else time.time()))

    def push(self, time_delta: float) -> None:
        """Add one duration."""
        self._samples.append(time_delta)
        if len(self._samples) > self._window_size:
            self._samples.pop(0)
        self.count += 1
        self._total_time += time_delta

    def push_units_processed(self, n: float) -> None:
        """Add the units the last block processed."""
        self._units_processed.append(n)
        if len(self._units_processed) > self._window_size:
            self._units_processed.pop(0)

    def has_units_processed(self) -> bool:
        """Whether any units were pushed."""
        return bool(self._units_processed)

    @property
    def mean(self) -> float:
        """Mean duration over the window."""
        return float(sum(self._samples)) / len(self._samples) if self._samples else 0.0

    @property
    def mean_units_processed(self) -> float:
        """Mean units over the window."""
        return float(sum(self._units_processed)) / len(self._units_processed) if self._units_processed else 0.0

    @property
    def mean_throughput(self) -> float:
        """Units per second over the window."""
        total = float(sum(self._samples))
        return float(sum(self._units_processed)) / total if total else 0.0


def is_async_func(func: Any) -> bool:
    """Whether ``func`` is an ``async def`` function or async generator."""
    return inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func)


@lru_cache(maxsize=2 ** 10)
def has_async_methods(cls: object) -> bool:
    """Whether the class has any async method (Ray then runs the actor on an event loop)."""
    return bool(inspect.getmembers(cls, predicate=is_async_func))


@contextlib.contextmanager
def profile(event_type: str, extra_data: dict[str, str] | None = None) -> Iterator[None]:
    """Ray's ``profiling.profile``: the block is a span named ``event_type`` (or
    ``extra_data["name"]``) of kind ``profile`` in this process's lane of ``ray.timeline()``.
    Podium's spans carry no other data: other ``extra_data`` keys are refused."""
    extra = dict(extra_data or {})
    name = str(extra.pop("name", event_type))
    if extra:
        raise InvalidArgumentError(f"profile(extra_data=...) keys {sorted(extra)} are not kept by Podium's "
                                   "timeline (only 'name'); put them in the event's name")
    started = now_ns()
    ok = False
    try:
        yield
        ok = True
    finally:
        RING.add("profile", name, started, now_ns(), ok=ok)


class RemoteFunctionNoArgs(Generic[R]):
    """Ray's typing class of a remote function taking no arguments; ROLL uses it only in an
    annotation (``Union[RemoteFunctionNoArgs[Worker], Type[Worker], str]``)."""

    def remote(self) -> Any:
        """The call; here only a type."""
        raise InvalidArgumentError("RemoteFunctionNoArgs is a typing class: use ray.remote(f)")
