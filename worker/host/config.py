"""What a worker host reads from its environment, and the defaults of its limits."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from podium import errors
from podium.transport.shm import DEFAULT_SHM_THRESHOLD_BYTES
from podium.worker.host.heldstore import default_budget

__all__ = ["HostConfig", "RAY_CALL", "FETCH_CALL", "DEFAULT_MAX_PAYLOAD_BYTES", "DEFAULT_SHM_THRESHOLD_BYTES",
           "DEFAULT_INLINE_RESULT_BYTES"]

#: Largest call payload a worker accepts unless PODIUM_MAX_PAYLOAD_BYTES says otherwise.
DEFAULT_MAX_PAYLOAD_BYTES = 16 << 30
#: Held results up to this size also travel inline with their ref (Ray inlines objects
#: below 100 KiB the same way); PODIUM_INLINE_RESULT_BYTES, 0 turns it off.
DEFAULT_INLINE_RESULT_BYTES = 64 << 10

#: Method name of the raw-call escape hatch: ``call(RAY_CALL, (fn, *args))`` runs
#: ``fn(hosted_object, *args)`` on the execution thread (Ray's ``actor.__ray_call__``).
RAY_CALL = "__ray_call__"
#: Method name of a fetch over the call connection: ``call(FETCH_CALL, (object_id, rows))``
#: returns a held result (or rows ``[start, stop)`` of it). On the raw call socket that is
#: a bulk frame straight into the fetcher's memory, where the ``Fetch`` RPC streams 4 MiB
#: protobuf chunks; run on the loop, so it never waits behind a running method.
FETCH_CALL = "__podium_fetch__"


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "")
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise errors.InvalidArgumentError(f"{name} must be an integer, got {text!r}") from None


@dataclasses.dataclass
class HostConfig:
    """What a worker host reads from its environment."""

    rank: int = 0
    world_size: int = 1
    worker_id: str = ""
    node_address: str = "127.0.0.1"
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    hold_budget_bytes: int = 0
    shm_threshold_bytes: int = DEFAULT_SHM_THRESHOLD_BYTES
    inline_result_bytes: int = DEFAULT_INLINE_RESULT_BYTES

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, address: str | None = None) -> "HostConfig":
        """Read RANK, WORLD_SIZE, PODIUM_WORKER_ID, PODIUM_NODE_ADDRESS and the byte limits."""
        env = os.environ if env is None else env
        return cls(rank=_int_env(env, "RANK", 0), world_size=_int_env(env, "WORLD_SIZE", 1),
                   worker_id=env.get("PODIUM_WORKER_ID", ""),
                   node_address=address or env.get("PODIUM_NODE_ADDRESS") or "127.0.0.1",
                   max_payload_bytes=_int_env(env, "PODIUM_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES),
                   hold_budget_bytes=default_budget(dict(env)),
                   shm_threshold_bytes=_int_env(env, "PODIUM_SHM_THRESHOLD_BYTES",
                                                DEFAULT_SHM_THRESHOLD_BYTES),
                   inline_result_bytes=_int_env(env, "PODIUM_INLINE_RESULT_BYTES",
                                                DEFAULT_INLINE_RESULT_BYTES))
