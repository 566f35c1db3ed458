"""No-op call round trip and payload throughput between a WorkerClient and a worker process.

Run: ``python bench/bench_worker_call.py [--calls N] [--mib M]``. Starts one worker
process the way the node agent does (``--ready-fd``), so the numbers include the
real worker loop (uvloop) and loopback TCP. Prints medians; not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

from podium import rpc
from podium.worker.caller.client import WorkerClient


class Noop:
    """The hosted object: a no-op, an async no-op and an echo."""

    def noop(self):
        return None

    async def anoop(self):
        return None

    def echo(self, value):
        return value


def spawn(token: str) -> tuple[subprocess.Popen, int]:
    """Start a worker process and wait for its port."""
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, PODIUM_TOKEN=token, PODIUM_NODE_ADDRESS="127.0.0.1", RANK="0", WORLD_SIZE="1")
    proc = subprocess.Popen([sys.executable, "-m", "podium.worker.host", "--ready-fd", str(write_fd)],
                            env=env, pass_fds=(write_fd,), stderr=subprocess.DEVNULL)
    os.close(write_fd)
    with os.fdopen(read_fd) as ready:
        port = json.loads(ready.readline())["port"]
    return proc, port


async def run(args) -> None:
    token = secrets.token_urlsafe(16)
    proc, port = spawn(token)
    try:
        client = WorkerClient(f"127.0.0.1:{port}", token)
        await client.start()
        await client.construct((Noop, (), {}))
        for method in ("noop", "anoop"):
            for _ in range(300):
                await client.call(method)
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    await client.call(method)
                samples.append((time.perf_counter() - t0) / args.calls * 1e3)
            print(f"{method}: median {statistics.median(samples):.3f} ms per call "
                  f"(sequential, {args.calls} calls x 5)")
        t0 = time.perf_counter()
        await asyncio.gather(*(client.call("noop") for _ in range(args.calls)))
        print(f"noop pipelined: {(time.perf_counter() - t0) / args.calls * 1e3:.3f} ms per call")
        import torch

        tensor = torch.ones(args.mib * 1024 * 1024 // 4)
        for transport in ("shm", "tcp"):
            client.same_host = transport == "shm"
            await client.call("echo", (tensor,))
            t0 = time.perf_counter()
            for _ in range(3):
                await client.call("echo", (tensor,))
            seconds = (time.perf_counter() - t0) / 3
            print(f"echo {args.mib} MiB over {transport}: {seconds * 1e3:.1f} ms, "
                  f"{2 * args.mib / 1024 / seconds:.2f} GiB/s (both ways counted)")
        await client.channel.shutdown("bench done")
        await client.close()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:  # interrupted: never leave the worker behind
            proc.kill()
            proc.wait(timeout=30)


def main() -> None:
    """Parse flags and run."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=128)
    args = parser.parse_args()
    rpc.use_uvloop()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
