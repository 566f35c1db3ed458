"""The spans a process recorded lately, for the timeline (``podium.timeline``).

Every Podium process (the controller and each worker) keeps its recent spans in one ring,
:data:`RING`: a ``collections.deque`` with a fixed ``maxlen`` of plain tuples, so recording
costs one ``time.time_ns()`` at each end and one append (thread-safe in CPython, no lock),
and memory stays bounded however long the job runs: the oldest spans fall out. The
controller asks every worker for its ring (the Worker ``Timeline`` RPC) and turns them all
into one Chrome trace (:mod:`podium.controller.observe.timeline`).

``PODIUM_TIMELINE=0`` turns recording off (``bench`` measures the cost side by side);
``PODIUM_TIMELINE_EVENTS`` sets the ring's size (65,536 spans by default, about 10 MiB).

Times are wall-clock nanoseconds (``time.time_ns``): spans of different machines are put on
one axis by the clock offset the controller measures when it collects them.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from typing import NamedTuple

__all__ = ["Span", "TraceRing", "RING", "enabled", "now_ns", "mono_to_ns", "next_trace_id", "MAX_EVENTS"]

#: Largest ring a process may ask for (``PODIUM_TIMELINE_EVENTS``).
MAX_EVENTS = 1 << 18  # (a full ring fits one gRPC message)
_DEFAULT_EVENTS = 1 << 16

now_ns = time.time_ns
# time.monotonic() readings (what the call paths already take) turned into wall-clock ns.
_MONO_OFFSET_NS = time.time_ns() - time.monotonic_ns()


#: ``next_trace_id()``: a new id for a group call, task or actor call of this process (the
#: ``CallHeader.trace_id`` every rank's span of it carries). ``next`` on a count is atomic.
next_trace_id = itertools.count(1).__next__


def mono_to_ns(seconds: float) -> int:
    """A ``time.monotonic()`` reading as wall-clock nanoseconds (``time.time_ns`` scale)."""
    return int(seconds * 1e9) + _MONO_OFFSET_NS


class Span(NamedTuple):
    """One recorded span (see the Worker service's ``TraceEvent`` for the fields' meaning)."""

    kind: str
    name: str
    start_ns: int
    end_ns: int
    trace_id: int = 0
    call_id: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    ok: bool = True
    thread: int = 0


def enabled() -> bool:
    """Whether this process records (``PODIUM_TIMELINE`` is not ``0``)."""
    return os.environ.get("PODIUM_TIMELINE", "1") != "0"


def _size() -> int:
    value = os.environ.get("PODIUM_TIMELINE_EVENTS")
    try:
        size = int(value) if value else _DEFAULT_EVENTS
    except ValueError:
        size = _DEFAULT_EVENTS
    return max(16, min(size, MAX_EVENTS))


class TraceRing:
    """A bounded ring of :class:`Span` tuples (see the module docstring)."""

    def __init__(self, size: int | None = None, on: bool | None = None) -> None:
        self._spans: collections.deque[tuple] = collections.deque(maxlen=size or _size())
        #: Whether :meth:`add` records (read by the hot paths before they take a time).
        self.on = enabled() if on is None else on
        self._added = 0

    def add(self, kind: str, name: str, start_ns: int, end_ns: int, trace_id: int = 0, call_id: int = 0,
            bytes_in: int = 0, bytes_out: int = 0, ok: bool = True) -> None:
        """Record one span (a no-op while :attr:`on` is False)."""
        if self.on:
            self._spans.append((kind, name, start_ns, end_ns, trace_id, call_id, bytes_in, bytes_out, ok,
                                threading.get_ident()))
            self._added += 1

    def spans(self, newest: int = 0) -> list[Span]:
        """The spans held, oldest first; only the ``newest`` many when that is positive."""
        held = list(self._spans)  # a copy first: other threads keep appending
        if newest > 0:
            held = held[-newest:]
        return [Span(*span) for span in held]

    @property
    def dropped(self) -> int:
        """Spans that fell out of the full ring since it was made."""
        return max(0, self._added - len(self._spans))

    def clear(self) -> None:
        """Forget every span (tests)."""
        self._spans.clear()
        self._added = 0


#: This process's ring.
RING = TraceRing()
