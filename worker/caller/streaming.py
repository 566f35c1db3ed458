"""The wire names and rules of a streaming call (Ray's ``num_returns="streaming"``), shared by
the caller's side (``podium.controller.remote.streams``) and the worker host
(:mod:`podium.worker.host.itemstreams`, which describes the protocol)."""

from __future__ import annotations

from typing import Any

from podium import errors

__all__ = ["STREAM_CALL", "STREAM_NEXT_CALL", "STREAM_CLOSE_CALL", "DEFAULT_BUFFER", "MAX_BUFFER", "check_buffer",
           "end_of_stream", "is_end_of_stream"]

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
