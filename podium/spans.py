"""Where bytes may already lie in shared memory the transport lends: a hook this layer reads
and the transport fills.

Concatenating a group's results (:mod:`podium.rowcat`) can skip its copy when the rows
already lie one after another in one staged segment (:mod:`podium.transport.shmstage`). The
transport sits above this layer, so the rows' side never imports it: the transport registers
its lookup here when it is imported (:func:`register`), and :func:`find` asks it. A process
that never imported it has no staged segment, so without a source there is nothing to find.
This module imports nothing, so the transport registering costs no torch.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["SpanSource", "register", "find"]

#: ``source(address, nbytes)``: a view of the ``nbytes`` at ``address`` when they lie in one
#: piece of memory the source owns (kept from reuse while the view lives), else None.
SpanSource = Callable[[int, int], memoryview | None]

_source: SpanSource | None = None


def register(source: SpanSource) -> None:
    """Make ``source`` the lookup :func:`find` asks; a later registration replaces it."""
    global _source
    _source = source


def find(address: int, nbytes: int) -> memoryview | None:
    """A view of ``nbytes`` at ``address`` from the registered source, or None (no source, or
    the bytes are not in one piece of its memory)."""
    source = _source
    return source(address, nbytes) if source is not None else None
