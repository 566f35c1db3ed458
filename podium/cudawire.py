"""CUDA tensors on the wire: where they arrive, and the optional CUDA IPC path.

The codec (:mod:`podium.codec`) sends a CUDA tensor as its bytes: it is made contiguous on
the device, copied to the host once, and travels as one raw buffer with a ``"cuda"`` device
tag. The receiver rebuilds it bit-exact and then:

* puts it on its own ``cuda:0`` when it has CUDA (a worker sees exactly its bundle's GPU
  as ``cuda:0``), with one host-to-device copy;
* leaves it on the CPU when it has no CUDA, or when ``PODIUM_CUDA_RECEIVE=cpu`` is set in
  the receiving process (a driver that only wants numbers on the host).

Opt-in CUDA IPC (``PODIUM_CUDA_IPC=1`` in the *sending* process, or :func:`set_ipc`):
CUDA tensors travel as CUDA IPC handles (torch's own ``torch.multiprocessing``
reductions) instead of bytes, so nothing is copied through the host. Only for receivers on
the same host that see the sender's GPU (found by UUID, so different
``CUDA_VISIBLE_DEVICES`` are fine); a receiver that does not see it fails with
DataLossError naming the GPU. The received tensor shares the sender's memory (writes are
visible to both) and the sender must stay alive while it is used. Whether it pays off
against the host copy is measured by ``bench/gpu_bench.py``, not assumed.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import os
from typing import Any

from podium.errors import DataLossError

__all__ = ["RECEIVE_ENV", "IPC_ENV", "receive_on_cuda", "ipc_enabled", "set_ipc", "to_receiver",
           "reduce_ipc", "rebuild_ipc"]

#: Receiving side: ``cpu`` keeps CUDA tensors on the host; anything else (default ``auto``)
#: puts them on ``cuda:0`` where CUDA is available.
RECEIVE_ENV = "PODIUM_CUDA_RECEIVE"
#: Sending side: ``1`` sends CUDA tensors as CUDA IPC handles (same host only).
IPC_ENV = "PODIUM_CUDA_IPC"

_ipc_override: bool | None = None
_has_cuda: bool | None = None


def receive_on_cuda() -> bool:
    """Whether a received CUDA tensor goes to ``cuda:0`` here (False: it stays on the CPU)."""
    global _has_cuda
    if os.environ.get(RECEIVE_ENV, "auto").strip().lower() == "cpu":
        return False
    if _has_cuda is None:
        import torch
        # Asked once: is_available() does not start a CUDA context, but asking costs a call
        # into the driver each time.
        _has_cuda = bool(torch.cuda.is_available())
    return _has_cuda


def ipc_enabled() -> bool:
    """Whether CUDA tensors are sent as IPC handles (:func:`set_ipc`, else ``PODIUM_CUDA_IPC``)."""
    if _ipc_override is not None:
        return _ipc_override
    return os.environ.get(IPC_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def set_ipc(enabled: bool | None) -> None:
    """Turn CUDA IPC sending on or off in this process (None: follow ``PODIUM_CUDA_IPC`` again)."""
    global _ipc_override
    _ipc_override = enabled


def to_receiver(tensor: Any) -> Any:
    """A rebuilt tensor that was on CUDA at the sender, moved where it arrives (see above)."""
    if receive_on_cuda():
        return tensor.to("cuda:0")
    return tensor


def _uuid_of(torch: Any, index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def reduce_ipc(torch: Any, tensor: Any) -> Any:
    """``(rebuild_ipc, args)`` for a CUDA tensor: torch's IPC reduction plus the GPU's UUID."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    return rebuild_ipc, (_uuid_of(torch, tensor.device.index or 0), rebuild, args)


def rebuild_ipc(gpu_uuid: str, rebuild: Any, args: tuple) -> Any:
    """Open a CUDA IPC tensor on the local index of GPU ``gpu_uuid`` (DataLossError if unseen)."""
    import torch  # already imported: the sender's tensor type came with it

    if not torch.cuda.is_available():
        raise DataLossError(f"a CUDA IPC tensor from GPU {gpu_uuid} arrived in a process without CUDA "
                            f"(send it without {IPC_ENV}=1)")
    for index in range(torch.cuda.device_count()):
        if _uuid_of(torch, index) == gpu_uuid:
            break
    else:
        raise DataLossError(f"a CUDA IPC tensor from GPU {gpu_uuid} arrived in a process that does not "
                            f"see that GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                            f"{IPC_ENV}=1 only works between processes sharing the GPU")
    fields = list(args)
    # torch's rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype,
    # storage_device, ...): the device index is the sender's numbering; use ours.
    fields[6] = index
    return rebuild(*fields)
