"""A short GPU benchmark: CUDA tensors through Podium against plain copies (about a minute).

    python bench/gpu_bench.py [--sizes-mib 16 256] [--repeat 5] [--json PATH]

Measures, on an embedded cluster over this machine's real GPUs (one worker on GPU 0):

* ``plain``: ``tensor.cuda()`` and ``tensor.cpu()`` in this process (the floor for one copy);
* ``podium_to_worker``: a CUDA tensor here -> the worker's cuda:0 (a device-to-host copy
  here, the bytes over shared memory, a host-to-device copy there), the call's round trip;
* ``podium_from_worker``: a CUDA tensor made by the worker -> this process's cuda:0;
* the same two over TCP (``PODIUM_DISABLE_SHM=1``, what a cross-host call costs);
* the same two as CUDA IPC handles (``PODIUM_CUDA_IPC=1``, same host, no host copy);
* ``dp_compute_proto``: DP_COMPUTE_PROTO calls with a CUDA DataProto (rows x 4096 bf16),
  the worker doubling it on its GPU and sending it back.

Every number is the median of ``--repeat`` runs after one warm-up, in GB/s (1e9 bytes per
second of tensor payload) or calls/s. Prints one line per measure and a final JSON line
(``GPUBENCH {...}``); ``--json PATH`` writes the same document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch


def _median_seconds(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up (allocator, connections, CUDA context)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker_class():
    from podium.dataproto import DataProto
    from podium.worker import Dispatch, Worker, register

    class BenchWorker(Worker):
        """Receives, makes and transforms CUDA tensors on its cuda:0."""

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def sink(self, x):
            assert x.device.type == "cuda"
            return x.numel()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def source(self, nbytes):
            return torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def double(self, data):
            return DataProto.from_dict(tensors={"y": data.batch["x"] * 2})

    return BenchWorker


def run(sizes_mib: list[int], repeat: int) -> dict:
    """Every measure of the module docstring; returns the summary document."""
    import podium
    from podium import cudawire
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.dataproto import DataProto

    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                               "cuda": torch.version.cuda, "repeat": repeat, "measures": []}

    def record(name: str, size: int, seconds: float, unit: str = "GB/s") -> None:
        value = size / seconds / 1e9 if unit == "GB/s" else 1.0 / seconds
        results["measures"].append({"measure": name, "bytes": size, "seconds": seconds, unit: round(value, 3)})
        print(f"{name:<34} {size / 2**20:>8.0f} MiB  {value:>9.2f} {unit}  ({seconds * 1e3:.2f} ms)", flush=True)

    for mib in sizes_mib:
        size = mib << 20
        host = torch.empty(size, dtype=torch.uint8).random_()
        dev = host.cuda()
        record("plain tensor.cuda()", size, _median_seconds(lambda: host.cuda(), repeat))
        record("plain tensor.cpu()", size, _median_seconds(lambda: dev.cpu(), repeat))
        dev = None  # free it before the next size

    podium.init(log_to_driver=False)
    cls = _worker_class()
    try:
        for mode, env in (("shm", {}), ("tcp", {"PODIUM_DISABLE_SHM": "1"}), ("ipc", {cudawire.IPC_ENV: "1"})):
            saved = os.environ.get("PODIUM_DISABLE_SHM")
            if mode == "tcp":
                os.environ["PODIUM_DISABLE_SHM"] = "1"  # the clients made from here on
            group = WorkerGroup(ResourcePool([1], max_colocate_count=4), ClassWithInitArgs(cls), worker_env=env)
            try:
                cudawire.set_ipc(mode == "ipc")
                for mib in sizes_mib:
                    size = mib << 20
                    x = torch.empty(size, dtype=torch.uint8, device="cuda:0").random_()
                    record(f"podium_to_worker ({mode})", size, _median_seconds(lambda: group.sink(x), repeat))
                    x = None
                    record(f"podium_from_worker ({mode})", size,
                           _median_seconds(lambda: group.source(size), repeat))
            finally:
                cudawire.set_ipc(None)
                group.shutdown()
                if saved is None:
                    os.environ.pop("PODIUM_DISABLE_SHM", None)
        group = WorkerGroup(ResourcePool([1], max_colocate_count=4), ClassWithInitArgs(cls))
        try:
            for rows in (64, 1024):
                data = DataProto.from_dict(tensors={"x": torch.randn(rows, 4096, device="cuda:0").bfloat16()})
                nbytes = rows * 4096 * 2
                seconds = _median_seconds(lambda: group.double(data), repeat)
                record(f"dp_compute_proto {rows}x4096 bf16", nbytes, seconds, unit="calls/s")
                results["measures"][-1]["GB/s"] = round(2 * nbytes / seconds / 1e9, 3)  # there and back
        finally:
            group.shutdown()
    finally:
        podium.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench: needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if not 1 <= args.repeat <= 100 or not all(1 <= m <= 8192 for m in args.sizes_mib):
        parser.error("--repeat must be in 1..100 and every --sizes-mib in 1..8192")
    doc = run(args.sizes_mib, args.repeat)
    line = json.dumps(doc)
    print("GPUBENCH " + line, flush=True)
    if args.json:
        with open(args.json, "w") as out:
            out.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
