"""Waiting with a deadline: the one polling loop of the suite, and the repository root."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: The repository's root folder.
REPO = pathlib.Path(__file__).resolve().parents[2]

#: How long a wait gives up after, unless told otherwise (seconds).
DEADLINE = 30.0


def eventually(predicate: Callable[[], T], what: str, timeout: float = DEADLINE, interval: float = 0.05) -> T:
    """Poll ``predicate()`` until it is truthy and return its value; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def eventually_async(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE,
                           interval: float = 0.05) -> Any:
    """:func:`eventually` on an event loop; ``predicate`` may return an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)
