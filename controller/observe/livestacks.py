"""``podium.stacks()``: the Python stack of every thread of the session's cluster's workers.

The scheduler lists the workers and their agents; :mod:`podium.workerstacks` asks them all in
parallel, each within a short deadline, so a stopped or stuck rank is named (with its /proc
state from its node agent) instead of holding the answer up.
"""

from __future__ import annotations

from typing import Any

from podium.limits import check_seconds
from podium.workerstacks import DEFAULT_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS, StackReport, collect

__all__ = ["stacks"]


def stacks(group: Any = None, rank: int | None = None, worker_id: str | None = None, *,
           timeout: float = DEFAULT_TIMEOUT_SECONDS) -> StackReport:
    """Stacks of the running workers that match: ``group`` (a name prefix, or a WorkerGroup),
    ``rank``, ``worker_id`` (an id or a worker name); every running worker when none is given.

    Each worker (and each node agent) gets ``timeout`` seconds. Returns one
    :class:`~podium.workerstacks.WorkerStacks` per worker; ``print()`` the result to read it.
    """
    from podium.controller.session.runtime import get_runtime

    check_seconds(timeout, "timeout", MAX_TIMEOUT_SECONDS)
    rt = get_runtime()
    name = getattr(group, "name_prefix", group)

    async def run() -> StackReport:
        state = await rt.cluster_state()
        return await collect(state, rt.token, rt.tls, group=name, rank=rank, worker_id=worker_id,
                             timeout=timeout)

    # The scheduler's answer, then one round of parallel asks each bounded by ``timeout``.
    return rt.run(run(), timeout=2 * timeout + 30.0, what="podium.stacks()")
