"""The weight broadcast over NCCL against NCCL's own broadcast, on two GPUs of one machine.

    python -m bench.broadcast_gpu [--mib 256 1024] [--repeat 5] [--json PATH]

Two processes, one GPU each (rank 0 sends, rank 1 is the replica). Per size: the bus
bandwidth of one ``torch.distributed`` broadcast of that many bytes (nccl-tests' busbw; for a
broadcast it equals the algorithm bandwidth), and the GB/s of
:class:`podium.rollout.broadcastcollective.CollectiveSender` moving that many bytes of float32
weights in 32 MiB tensors and 256 MiB buckets (manifests through the store, one broadcast per
bucket, the bucket packed on the sender's device). Medians after one warm-up. Fewer than two
GPUs: it says so and measures nothing. Run by tools/gpu-check.sh; not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _rank(rank: int, mibs: list[int], repeat: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from bench.gpu_bench import _median_seconds
    from podium.rollout.broadcastcollective import CollectiveReceiver, CollectiveSender

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = []
    sender = CollectiveSender(replicas=1, bucket_bytes=256 << 20, timeout=120, backend="nccl") if rank == 0 else None
    meta = [sender.prepare() if sender else None]
    dist.broadcast_object_list(meta, src=0)
    receiver = None if sender else CollectiveReceiver(name="gpu1", timeout=120)
    if receiver:
        receiver.join(meta[0], 1)
    for mib in mibs:
        raw = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
        weights = {f"w{i}": torch.ones(min(32, mib - 32 * i) << 18, device="cuda") for i in range(-(-mib // 32))}

        def nccl() -> None:
            dist.broadcast(raw, src=0)
            torch.cuda.synchronize()

        def podium() -> None:
            if sender:
                sender.send(weights.items())
            else:
                assert sum(t.numel() for _, t in receiver.receive()) == sum(t.numel() for t in weights.values())
            torch.cuda.synchronize()
            dist.barrier()

        for name, fn in (("nccl broadcast busbw", nccl), ("podium collective broadcast", podium)):
            seconds = _median_seconds(fn, repeat)
            results.append({"measure": name, "mib": mib, "GB/s": round((mib << 20) / 1e9 / seconds, 2)})
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)
        sender.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Spawn the two ranks, print each measure."""
    parser = argparse.ArgumentParser(prog="python -m bench.broadcast_gpu")
    parser.add_argument("--mib", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import tempfile

    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print(f"weight broadcast over NCCL needs two GPUs; this machine has "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}: nothing measured")
        return 0
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = args.json or os.path.join(tempfile.mkdtemp(), "broadcast-gpu.json")
    mp.spawn(_rank, args=(args.mib, args.repeat, port, out), nprocs=2, join=True)
    for row in json.load(open(out)):
        print(f"{row['measure']:<30} {row['mib']:>6} MiB  {row['GB/s']:>7} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
