"""The Ray side of ``python -m bench.broadcast``: a trainer actor's weights to N replica actors.

    python -m bench.broadcast_ray --mode put|put-two-nodes|collective --mib 512 --replicas 4 [--repeat 3]

Run by bench.broadcast in a child of its own with the interpreter that has Ray
(``--ray-python``, ``tools/install-bench-ray.sh``); prints one ``BCAST {json}`` line per cell.
The trainer holds ``--mib`` MiB of float32 in 32 MiB tensors, each replica the same shapes
zeroed; one update is timed from the trainer's start to the last replica's weights loaded.

- ``put``: the trainer ``ray.put``\\ s its state dict and every replica gets it (the object
  store's shared memory on one node) and copies it into its own tensors;
- ``put-two-nodes``: the same with the replicas on a second raylet (``ray.cluster_utils``),
  so the bytes cross Ray's object manager, as between hosts;
- ``collective``: ``ray.util.collective`` with the gloo backend, one group of the trainer and
  the N replicas, one ``broadcast`` per tensor straight into the replicas' tensors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

TENSOR_MIB = 32


def shapes(mib: int) -> dict[str, tuple[int]]:
    """``{name: (numel,)}`` of ``mib`` MiB of float32 in tensors of at most 32 MiB (bench.broadcast's)."""
    sizes = [TENSOR_MIB] * (mib // TENSOR_MIB) + ([mib % TENSOR_MIB] if mib % TENSOR_MIB else [])
    return {f"layer{i}.weight": (size << 18,) for i, size in enumerate(sizes)}


def main(argv: list[str] | None = None) -> int:
    """Measure one (mode, size, replicas) cell; prints its BCAST line."""
    parser = argparse.ArgumentParser(prog="python -m bench.broadcast_ray")
    parser.add_argument("--mode", choices=["put", "put-two-nodes", "collective"], required=True)
    parser.add_argument("--mib", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if not (1 <= args.mib <= 16384 and 1 <= args.replicas <= 64 and 1 <= args.repeat <= 100):
        parser.error("--mib in [1, 16384], --replicas in [1, 64], --repeat in [1, 100]")

    import ray
    import torch

    n = args.replicas
    if args.mode == "put-two-nodes":
        from ray.cluster_utils import Cluster

        # The trainer on the head, the replicas on a second raylet: each get crosses nodes.
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=n, resources={"replicas": n})
        ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
        replica_opts = {"resources": {"replicas": 1}}
    else:
        # address="local": a cluster of its own, never one a previous cell left behind.
        ray.init(address="local", num_cpus=n + 1, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")
        replica_opts = {}
        cluster = None

    @ray.remote(num_cpus=1)
    class Trainer:
        def __init__(self, mib: int) -> None:
            self.state = {k: torch.full(s, 1.5) for k, s in shapes(mib).items()}

        def put_state(self) -> list:
            return [ray.put(self.state)]  # in a list: the caller gets the ref, not the value

        def broadcast(self) -> None:
            from ray.util import collective

            for tensor in self.state.values():
                collective.broadcast(tensor, src_rank=0, group_name="bench")

    @ray.remote(num_cpus=1)
    class Replica:
        def __init__(self, mib: int) -> None:
            self.state = {k: torch.zeros(s) for k, s in shapes(mib).items()}

        def load(self, new: dict) -> float:
            with torch.no_grad():
                for name, tensor in new.items():
                    self.state[name].copy_(tensor)
            return float(self.state[next(iter(self.state))][0])

        def broadcast(self) -> float:
            from ray.util import collective

            for tensor in self.state.values():
                collective.broadcast(tensor, src_rank=0, group_name="bench")
            return float(self.state[next(iter(self.state))][0])

    trainer = Trainer.remote(args.mib)
    replicas = [Replica.options(**replica_opts).remote(args.mib) for _ in range(n)]
    if args.mode == "collective":
        from ray.util import collective

        collective.create_collective_group([trainer, *replicas], world_size=n + 1, ranks=list(range(n + 1)),
                                           backend="gloo", group_name="bench")

    def update() -> None:
        if args.mode == "collective":
            values = ray.get([trainer.broadcast.remote(), *[r.broadcast.remote() for r in replicas]])[1:]
        else:
            ref = ray.get(trainer.put_state.remote())[0]
            values = ray.get([r.load.remote(ref) for r in replicas])
            del ref
        assert values == [1.5] * n, values

    update()  # warm-up (and the collective group's rendezvous)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        update()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    print("BCAST " + json.dumps({"backend": f"ray {args.mode}", "mib": args.mib, "replicas": n,
                                 "seconds": seconds, "all": times,
                                 "mb_s": (args.mib << 20) / 1e6 / seconds}), flush=True)
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
