"""A verl platform plugin for a CPU-only machine, registered as 'cpu' (gloo, torch.cpu).

verl loads it through its own extension points: ``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform``
imports it in every process that imports verl, ``VERL_PLATFORM=cpu`` selects it. GPUs stay
the resource verl's pools ask for (``podium run --num-gpus`` gives fake ones)."""
from contextlib import contextmanager

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """The CPU as verl's accelerator."""

    device_name = "cpu"
    vendor_name = "cpu"

    @property
    def device_module(self):
        return torch.cpu

    def is_available(self): return True
    def current_device(self): return 0
    def device_count(self): return 1
    def set_device(self, device_index): return None
    def synchronize(self, device_index=None): return None
    def manual_seed(self, seed): torch.manual_seed(seed)
    def manual_seed_all(self, seed): torch.manual_seed(seed)
    def set_allocator_settings(self, settings): return None
    def empty_cache(self): return None
    def get_device_capability(self, device_index=0): return (None, None)
    def communication_backend_name(self): return "gloo"
    def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self): return None
    def profiler_stop(self): return None
    def ray_resource_name(self): return "GPU"
    def ray_noset_envvars(self): return []
    def is_ipc_supported(self): return False

    @property
    def cudart(self): return None
