"""A deadline for the WorkerGroup calls of a block of code: ``with call_timeout(30): ...``.

verl-style worker methods cannot take extra keyword arguments, so the deadline of a call
is not an argument: it is the runtime's ``call_timeout`` (``init(call_timeout=...)`` or
``PODIUM_CALL_TIMEOUT``; by default none), or, inside ``with call_timeout(seconds):``, that
many seconds for every call the block starts in this thread (or task), and for ``get`` of
their results. Blocks nest; the innermost wins. A call that runs past it raises
:class:`~podium.errors.DeadlineExceededError` naming the ranks that did not answer.

Without a deadline, as in Ray, a call waits as long as its worker lives: a call that lasts the
whole training (verl's ``ray.get(runner.run.remote(config))``) is not an error. A worker that
dies fails its calls within about a second (the death watch), and one that stops answering
within ``PODIUM_LIVENESS_SECONDS`` (liveness), so no wait outlasts its peer.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

from podium.errors import InvalidArgumentError

__all__ = ["call_timeout", "effective_call_timeout", "parse_call_timeout", "plus", "MAX_CALL_TIMEOUT_SECONDS"]

#: Longest deadline a block may set (a week): a bound, like every duration a client sets.
MAX_CALL_TIMEOUT_SECONDS = 7 * 24 * 3600.0

_override: contextvars.ContextVar[float | None] = contextvars.ContextVar("podium_call_timeout",
                                                                         default=None)


@contextlib.contextmanager
def call_timeout(seconds: float) -> Iterator[float]:
    """Give every WorkerGroup call (and ``get``) started inside the block ``seconds`` to finish.

    ``InvalidArgumentError`` unless ``0 < seconds <= MAX_CALL_TIMEOUT_SECONDS``.
    """
    seconds = _check(seconds, "call_timeout")
    token = _override.set(seconds)
    try:
        yield seconds
    finally:
        _override.reset(token)


def _check(seconds: object, what: str) -> float:
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds)
            or not 0 < seconds <= MAX_CALL_TIMEOUT_SECONDS):
        raise InvalidArgumentError(f"{what} wants seconds in (0, {MAX_CALL_TIMEOUT_SECONDS:g}], got {seconds!r}")
    return float(seconds)


def parse_call_timeout(value: float | None, env: str | None) -> float | None:
    """The session's default deadline: ``value`` (``init(call_timeout=...)``), else the text
    of ``PODIUM_CALL_TIMEOUT`` (``env``; empty, "0" or "none": no deadline), else none."""
    if value is not None:
        return _check(value, "call_timeout")
    if env is None or env.strip().lower() in ("", "0", "none"):
        return None
    try:
        seconds = float(env)
    except ValueError:
        raise InvalidArgumentError(f"PODIUM_CALL_TIMEOUT={env!r} is not a number of seconds") from None
    return _check(seconds, "PODIUM_CALL_TIMEOUT")


def effective_call_timeout(default: float | None) -> float | None:
    """The innermost ``call_timeout`` block's seconds, else ``default`` (the runtime's; None:
    no deadline)."""
    value = _override.get()
    return default if value is None else value


def plus(timeout: float | None, margin: float) -> float | None:
    """``timeout`` and a margin (for a wait around a call that has its own deadline); None
    stays None."""
    return None if timeout is None else timeout + margin
