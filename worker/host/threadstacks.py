"""The Python stack of every thread of this process (``Worker.Stacks``).

Read with :func:`sys._current_frames` from the worker's event loop: it needs the GIL only for
the moment it reads, so it answers while a method runs in the execution thread, even one
spinning in pure Python (the interpreter hands the GIL over every few milliseconds). A
thread stuck in native code that holds the GIL, or a stopped process, cannot answer;
callers learn that from the node agent (``NodeAgent.ProcessStates``).
"""

from __future__ import annotations

import sys
import threading
import traceback

from podium import errors
from podium.v1 import worker_pb2

__all__ = ["DEFAULT_MAX_FRAMES", "MAX_FRAMES", "thread_stacks"]

#: Innermost frames kept per thread when the request does not say.
DEFAULT_MAX_FRAMES = 100
#: The most a request may ask for (a deep recursion would otherwise make megabytes).
MAX_FRAMES = 1000


def thread_stacks(max_frames: int = 0) -> list[worker_pb2.ThreadStack]:
    """One :class:`ThreadStack` per thread running Python code, in thread-start order."""
    if not 0 <= max_frames <= MAX_FRAMES:
        raise errors.InvalidArgumentError(f"max_frames must be in [0, {MAX_FRAMES}], got {max_frames}")
    limit = max_frames or DEFAULT_MAX_FRAMES
    frames = sys._current_frames()
    known = {t.ident: t for t in threading.enumerate()}
    # Threads threading knows first, in start order; then any it does not (a C extension's).
    order = [ident for ident in known if ident in frames] + [i for i in frames if i not in known]
    out: list[worker_pb2.ThreadStack] = []
    for ident in order:
        frame = frames[ident]
        summary = traceback.extract_stack(frame, limit=limit)
        depth, back = 0, frame.f_back
        while back is not None:
            depth, back = depth + 1, back.f_back
        depth += 1
        thread = known.get(ident)
        out.append(worker_pb2.ThreadStack(
            name=thread.name if thread is not None else "", ident=ident,
            native_id=(thread.native_id or 0) if thread is not None else 0,
            daemon=thread.daemon if thread is not None else False,
            stack="".join(traceback.format_list(summary)),
            frames_omitted=max(0, depth - len(summary))))
    del frames  # frames keep their locals alive
    return out
