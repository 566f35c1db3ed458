"""How the agent launches a worker process: its argv and its environment."""

from __future__ import annotations

import signal
from typing import Mapping, Sequence

from podium.auth import TlsConfig
from podium.process import die_with_parent_argv

__all__ = ["ALLOCATOR_DEFAULTS", "TLS_ENV_KEYS", "launch_argv", "with_allocator_defaults", "worker_env"]

#: Allocator settings every worker (and the fork server) gets unless the agent's environment
#: sets them. ``THP_MEM_ALLOC_ENABLE=1``: torch backs its CPU allocations of 2 MiB and more
#: with transparent huge pages (``madvise``). glibc serves each allocation over 32 MiB with a
#: fresh mapping, so a method's new 128 MiB result faulted in 32,768 pages every call: 53 ms
#: of a 128 MiB ``torch.ones`` here, against 17.5 ms with 2 MiB pages (~580 faults), and a fresh
#: result went back at 1,964 against 5,110 MB/s on one host (``python -m bench.crosshost``,
#: the ``fresh`` cell). ``THP_MEM_ALLOC_ENABLE=0`` in the agent's environment switches it off.
#: (Keeping freed memory in glibc's heap instead, ``MALLOC_MMAP_MAX_=0`` with a high trim
#: threshold, worked for ``malloc`` but not for torch's ``posix_memalign``: still one fault
#: per page.)
ALLOCATOR_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


def launch_argv(command: Sequence[str], ready_fd: int) -> list[str]:
    """The argv that starts a worker: the shim (Linux) then ``command --ready-fd N``."""
    return die_with_parent_argv([*command, "--ready-fd", str(ready_fd)], signal.SIGKILL)


#: Environment variables naming a worker's mutual-TLS files (read by podium.worker.host.process).
TLS_ENV_KEYS = ("PODIUM_TLS_CERT", "PODIUM_TLS_KEY", "PODIUM_TLS_CA")


def with_allocator_defaults(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with :data:`ALLOCATOR_DEFAULTS` where it does not set them (the agent's base
    environment for its workers and fork server)."""
    return {**ALLOCATOR_DEFAULTS, **base}


def worker_env(base: Mapping[str, str], env: Mapping[str, str], *, token: str,
               scheduler: str, worker_id: str = "", node_address: str = "",
               tls: TlsConfig | None = None) -> dict[str, str]:
    """The environment of a worker process (see the module docstring).

    ``env`` (the scheduler's WorkerInfo.env) wins over ``base``; the token, the
    scheduler address, the worker id and node address are only filled in when absent.
    The TLS variables are exactly the agent's ``tls`` (none without it): a worker
    serves with the agent's security, whatever the environment says.
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` unless ``env`` says otherwise, so the NVML
    indices in CUDA_VISIBLE_DEVICES mean the same GPUs to CUDA.
    """
    out = {k: v for k, v in base.items() if k != "PODIUM_TOKEN_FILE"}
    out.update(env)
    for key in TLS_ENV_KEYS:
        out.pop(key, None)
    if tls is not None:
        out.update(zip(TLS_ENV_KEYS, (tls.cert, tls.key, tls.ca)))
    defaults = {"PODIUM_TOKEN": token, "PODIUM_SCHEDULER": scheduler,
                "PODIUM_WORKER_ID": worker_id, "PODIUM_NODE_ADDRESS": node_address}
    for key, value in defaults.items():
        if value and key not in env:
            out[key] = value
    # CUDA_VISIBLE_DEVICES carries NVML indices, which follow PCI bus order;
    # CUDA's default order (fastest first) may differ on mixed machines.
    if "CUDA_DEVICE_ORDER" not in env:
        out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    out["PYTHONUNBUFFERED"] = "1"
    return out
