"""Measurement shim for tools/vllm_ray_cpu/run.py (see there): not Podium code."""
# vLLM's CPU platform has no Ray device key: give it one (a custom resource).
import os
if os.environ.get("SHIM_DEVICE_KEY"):
    import importlib.abc, importlib.machinery, sys

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "vllm.platforms.cpu":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            loader = spec.loader
            orig = loader.exec_module

            def exec_module(module):
                orig(module)
                module.CpuPlatform.ray_device_key = "cpu_device"
            loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _Hook())
    try:
        import podium.compat.ray as _pray
        _orig_ids = _pray.RuntimeContext.get_accelerator_ids
        _pray.RuntimeContext.get_accelerator_ids = lambda self: {**_orig_ids(self), "cpu_device": ["0"]}
    except Exception:
        pass
