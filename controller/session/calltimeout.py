"""A deadline for the WorkerGroup calls of a block of code: ``with call_timeout(30): ...``.

verl-style worker methods cannot take extra keyword arguments, so the deadline of a call
is not an argument: it is the runtime's ``call_timeout`` (``init(call_timeout=...)``,
``PODIUM_CALL_TIMEOUT``, an hour by default), or, inside ``with call_timeout(seconds):``,
that many seconds for every call the block starts in this thread (or task), and for
``get`` of their results. Blocks nest; the innermost wins. A call that runs past it
raises :class:`~podium.errors.DeadlineExceededError` naming the ranks that did not answer.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

from podium.errors import InvalidArgumentError

__all__ = ["call_timeout", "effective_call_timeout", "MAX_CALL_TIMEOUT_SECONDS"]

#: Longest deadline a block may set (a week): a bound, like every duration a client sets.
MAX_CALL_TIMEOUT_SECONDS = 7 * 24 * 3600.0

_override: contextvars.ContextVar[float | None] = contextvars.ContextVar("podium_call_timeout",
                                                                         default=None)


@contextlib.contextmanager
def call_timeout(seconds: float) -> Iterator[float]:
    """Give every WorkerGroup call (and ``get``) started inside the block ``seconds`` to finish.

    ``InvalidArgumentError`` unless ``0 < seconds <= MAX_CALL_TIMEOUT_SECONDS``.
    """
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds)
            or not 0 < seconds <= MAX_CALL_TIMEOUT_SECONDS):
        raise InvalidArgumentError(
            f"call_timeout wants seconds in (0, {MAX_CALL_TIMEOUT_SECONDS:g}], got {seconds!r}")
    token = _override.set(float(seconds))
    try:
        yield float(seconds)
    finally:
        _override.reset(token)


def effective_call_timeout(default: float) -> float:
    """The innermost ``call_timeout`` block's seconds, else ``default`` (the runtime's)."""
    value = _override.get()
    return default if value is None else value
