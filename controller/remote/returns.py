"""``num_returns=N`` (Ray's multiple returns): one call, N refs, one per item of its result.

The call runs as any other and returns one value; its N refs settle once it finished: the
value is fetched here, checked to be a tuple or list of exactly N items, and each item is put
in this process's object store (``podium.put``), so every ref works wherever a result ref
does (``get``, ``wait``, an argument of another call). A failed call fails all N with its
error; a result of another length fails all N with an error naming both counts. The items
travel through the caller: fine for the small tuples ``num_returns`` is used for.
``num_returns="streaming"`` is :mod:`.streams`' (:data:`~.streams.STREAMING`).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from podium.controller.remote.streams import STREAMING, Streaming
from podium.controller.session.futures import PendingRef
from podium.errors import InvalidArgumentError, UnimplementedError
from podium.worker.caller.streaming import NUM_RETURNS_ATTR

__all__ = ["MAX_RETURNS", "check_num_returns", "split_returns", "NUM_RETURNS_ATTR"]

#: Most refs one call may return.
MAX_RETURNS = 1024

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def check_num_returns(value: Any) -> int | Streaming:
    """``num_returns`` as an int in [1, MAX_RETURNS] (None: 1), or :data:`~.streams.STREAMING`
    for ``"streaming"``; else InvalidArgumentError (``"dynamic"``: UnimplementedError)."""
    if value is None:
        return 1
    if isinstance(value, str) and value == "streaming":
        return STREAMING
    if isinstance(value, str) and value == "dynamic":
        raise UnimplementedError('num_returns="dynamic" is not supported by Podium (Ray deprecated it): use '
                                 'num_returns="streaming", whose refs come as the generator yields')
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RETURNS:
        raise InvalidArgumentError(f"num_returns must be an int in [1, {MAX_RETURNS}], got {value!r}")
    return value


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    # Settling fetches the value and puts its items, which block on the runtime's loop: not on
    # the loop thread that settles the call, so on these threads.
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="podium-returns")
        return _pool


def split_returns(ref: PendingRef, n: int) -> list[PendingRef]:
    """N refs to the items of the result of the call ``ref`` stands for (see the module)."""
    children = [PendingRef(ref.rank, f"{ref.method}[{i}]") for i in range(n)]
    for child in children:
        child.keep = ref.keep  # an actor call's handle keeps the actor alive, as the ref did

    def settle() -> None:
        from podium.controller.remote.objects import put

        try:
            value = ref.get()
            if not isinstance(value, (tuple, list)) or len(value) != n:
                got = f"a {type(value).__name__} of {len(value)}" if isinstance(value, (tuple, list)) \
                    else f"one {type(value).__name__}"
                raise InvalidArgumentError(f"{ref.method} has num_returns={n} but returned {got}, not a "
                                           f"tuple or list of {n}")
            items = [put(item) for item in value]
        except BaseException as exc:  # noqa: BLE001 - every ref reports the call's error
            for child in children:
                child.set_exception(exc)
            return
        for child, item in zip(children, items):
            child.set_result(item)

    def start(_done: PendingRef) -> None:
        _executor().submit(settle)

    ref.add_done_callback(start)
    return children
