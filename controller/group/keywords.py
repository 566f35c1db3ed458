"""The keywords ``WorkerGroup(...)`` takes beyond its named parameters: those verl 0.9.1's
``RayWorkerGroup`` reads from its ``**kwargs``, each honoured, refused with the Podium
alternative, or accepted because it cannot matter on Podium. Any other keyword is an
:class:`~podium.errors.InvalidArgumentError` naming the closest known one
(``WorkerGroup(..., standy=1)`` suggests ``standby``): a misspelt keyword is never ignored.
"""

from __future__ import annotations

import difflib
from typing import Any

from podium.errors import InvalidArgumentError, UnimplementedError

__all__ = ["NAMED", "KWARGS", "REFUSED", "check_keywords"]

#: The named parameters of ``WorkerGroup.__init__`` (verl's and Podium's own), for suggestions.
NAMED = ("resource_pool", "ray_cls_with_init", "bin_pack", "name_prefix", "detached", "worker_names",
         "worker_handles", "worker_env", "gpu_memory_cap", "standby", "on_rank_death")
#: verl 0.9.1's ``RayWorkerGroup`` keywords read from ``**kwargs`` (and its
#: ``ray_wait_register_center_timeout`` parameter), with what Podium does with each.
KWARGS = {
    "use_gpu": "honoured: whether the workers ask for GPUs (default: the pool's)",
    "device_name": "honoured: verl's device name ('cuda', 'npu', 'cpu')",
    "master_addr": "refused unless None: the scheduler reserves MASTER_PORT on rank 0's node",
    "master_port": "refused unless None: the scheduler reserves MASTER_PORT on rank 0's node",
    "master_port_range": "refused unless None: the scheduler reserves MASTER_PORT on rank 0's node",
    "worker_nsight_options": "refused unless None: start the node agent under `nsys profile`",
    "profile_steps": "no effect: verl's RayWorkerGroup reads it only with worker_nsight_options",
    "ray_wait_register_center_timeout": "no effect: Podium's workers register with the scheduler, "
                                        "not with a register-center actor",
}
#: Keywords of KWARGS refused unless None, and the Podium alternative.
REFUSED = {
    "master_port_range": "the scheduler reserves MASTER_PORT on rank 0's node",
    "worker_nsight_options": "start the node agent under `nsys profile` (podium node)",
}


def check_keywords(kwargs: dict[str, Any]) -> None:
    """Refuse unknown keywords (naming the closest known one) and refused ones set to a value."""
    for key, value in kwargs.items():
        if key not in KWARGS:
            close = difflib.get_close_matches(key, [*NAMED, *KWARGS], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InvalidArgumentError(f"WorkerGroup got an unknown keyword {key!r}{hint} (it takes "
                                       f"{', '.join(NAMED)} and verl's {', '.join(sorted(KWARGS))})")
        if key in REFUSED and value is not None:
            raise UnimplementedError(f"WorkerGroup({key}={value!r}) is not supported by Podium: {REFUSED[key]}")
