"""The wire names and rules of a streaming call (Ray's ``num_returns="streaming"``), shared by
the caller's side (``podium.controller.remote.streams``) and the worker host
(:mod:`podium.worker.host.itemstreams`, which describes the protocol); and what a class
declares its methods return (:func:`declared_returns`), which a worker also tells in
``Describe`` so that a handle from ``get_actor`` calls them as the owner's does."""

from __future__ import annotations

import inspect
from typing import Any

from podium import errors
from podium.limits import MAX_MAP_ENTRIES

__all__ = ["STREAM_CALL", "STREAM_NEXT_CALL", "STREAM_CLOSE_CALL", "DEFAULT_BUFFER", "MAX_BUFFER", "check_buffer",
           "end_of_stream", "is_end_of_stream", "NUM_RETURNS_ATTR", "BACKPRESSURE_ATTR", "STREAMING_RETURNS",
           "declared_returns"]

#: The attribute ``ray.method(num_returns=...)`` sets on a method: N, or :data:`STREAMING_RETURNS`.
NUM_RETURNS_ATTR = "__podium_num_returns__"
#: The attribute ``ray.method(_generator_backpressure_num_objects=N)`` sets on a method.
BACKPRESSURE_ATTR = "__podium_generator_backpressure__"
#: ``num_returns="streaming"``, as a method's attribute and ``DescribeResponse.method_returns`` say it.
STREAMING_RETURNS = -1

#: Prefix of a streaming call's method name: ``STREAM_CALL + name`` streams ``name``'s items.
STREAM_CALL = "__podium_stream__:"
#: ``call(STREAM_NEXT_CALL, (stream_id,))``: the next item's ref, the generator's error, or the end.
STREAM_NEXT_CALL = "__podium_stream_next__"
#: ``call(STREAM_CLOSE_CALL, (stream_id, final))``: the caller dropped the stream (``final``:
#: its streaming call has ended, so nothing of it may wait for a start).
STREAM_CLOSE_CALL = "__podium_stream_close__"
#: Items a stream buffers when the call names no bound (Ray's default is no bound; Podium's
#: generators wait at their ``yield`` this far ahead of the caller).
DEFAULT_BUFFER = 1024
#: The largest bound a call may name (``-1``, Ray's "no backpressure", takes this one).
MAX_BUFFER = 65_536


def check_buffer(value: Any) -> int:
    """A checked ``_generator_backpressure_num_objects``: None gives :data:`DEFAULT_BUFFER`,
    -1 (Ray's "no backpressure") :data:`MAX_BUFFER`; else an int in [1, MAX_BUFFER]
    (InvalidArgumentError otherwise; Ray refuses 0 too)."""
    if value is None:
        return DEFAULT_BUFFER
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or 1 <= value <= MAX_BUFFER):
        raise errors.InvalidArgumentError(f"_generator_backpressure_num_objects must be -1 or an int in "
                                          f"[1, {MAX_BUFFER}], got {value!r}")
    return MAX_BUFFER if value == -1 else value


def end_of_stream(stream_id: str) -> errors.OutOfRangeError:
    """The answer to a ``next`` past a stream's last item."""
    return errors.OutOfRangeError(f"stream {stream_id} has no more items", details={"stream": "end"})


def is_end_of_stream(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a ``next``'s end of stream (not an item's error)."""
    return isinstance(exc, errors.OutOfRangeError) and exc.details.get("stream") == "end"


def declared_returns(cls: type) -> dict[str, tuple[int, int | None]]:
    """The methods of ``cls`` that return other than one ref: name -> (N, or
    :data:`STREAMING_RETURNS`; their ``_generator_backpressure_num_objects`` or None). A
    generator or async generator method without ``ray.method(num_returns=...)`` streams, as
    in Ray. At most ``MAX_MAP_ENTRIES`` methods (what ``Describe`` may carry)."""
    found: dict[str, tuple[int, int | None]] = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        try:
            fn = inspect.getattr_static(cls, name)
        except AttributeError:
            continue
        fn = getattr(fn, "__func__", fn)  # a staticmethod's or classmethod's function
        n = getattr(fn, NUM_RETURNS_ATTR, None)
        if n is None and (inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)):
            n = STREAMING_RETURNS
        if isinstance(n, int) and n != 1:
            found[name] = (n, getattr(fn, BACKPRESSURE_ATTR, None) if n == STREAMING_RETURNS else None)
            if len(found) >= MAX_MAP_ENTRIES:
                break
    return found
