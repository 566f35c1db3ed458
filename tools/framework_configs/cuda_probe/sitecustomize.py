"""For tools/framework_entry.py only (a measurement, never on a real cluster): make torch
*report* CUDA devices on a machine without them, so a framework that picks its platform from
``torch.cuda.is_available()`` (ROLL's ``roll/platforms``) takes the path it takes on a GPU
machine. Only the three queries are answered (``is_available``: True, ``device_count``:
``PODIUM_PROBE_CUDA_DEVICES``, ``get_device_name``: an NVIDIA name); every other CUDA call is
torch's own and fails as it does without a GPU, which is the line the runner reports. Loaded
as ``sitecustomize`` from PYTHONPATH in the driver and in every worker of the run."""

import os

_count = int(os.environ.get("PODIUM_PROBE_CUDA_DEVICES", "0"))
if _count > 0:
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: _count
        torch.cuda.get_device_name = lambda device=None: "NVIDIA (reported by Podium's framework_entry probe: no device)"
