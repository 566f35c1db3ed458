"""Worker processes on real GPUs (the embedded cluster on this machine's NVML GPUs): each
worker sees exactly its bundle's GPU as cuda:0; three colocated workers share one GPU and
/v1/placement shows each one's real memory; torch.distributed across two workers (NCCL, or
gloo where NCCL refuses two ranks on one GPU); CUDA tensors through a WorkerGroup, over
shared memory, over TCP (PODIUM_DISABLE_SHM=1), worker to worker, and as CUDA IPC handles."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch

import podium
from podium import cudawire
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.dataproto import DataProto
from podium.worker import Dispatch, Worker, register

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

HOLD_BYTES = 256 << 20


def _uuid(index: int = 0) -> str:
    return "GPU-" + str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")


class GpuWorker(Worker):
    """Reports what CUDA it sees, holds memory, runs collectives, computes on CUDA batches."""

    def __init__(self):
        super().__init__()
        self.held = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sees(self):
        return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count(),
                "uuid": _uuid(0), "pid": os.getpid()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hold(self, nbytes):
        self.held = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        return {"uuid": _uuid(0), "pid": os.getpid()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def allreduce(self, init_methods, rank=None, world_size=None):
        import torch.distributed as dist

        rank = self.rank if rank is None else rank
        world_size = self.world_size if world_size is None else world_size
        tried = []
        for backend, init_method in init_methods:
            try:
                dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=60))
                x = torch.full((4096,), float(rank + 1), device="cuda:0")
                dist.all_reduce(x)
                torch.cuda.synchronize()
                return {"backend": backend, "value": float(x[0]), "device": str(x.device), "tried": tried}
            except Exception as exc:  # noqa: BLE001 - NCCL refusing two ranks on one GPU: try the next
                tried.append(f"{backend}: {type(exc).__name__}: {str(exc)[:300]}")
            finally:
                if dist.is_initialized():
                    try:
                        dist.destroy_process_group()
                    except Exception as exc:  # noqa: BLE001 - a refused NCCL group may not tear down cleanly
                        tried.append(f"destroying the {backend} group: {type(exc).__name__}: {exc}")
        raise RuntimeError(f"no backend worked: {tried}")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data):
        x = data.batch["x"]
        assert x.device == torch.device("cuda:0"), x.device
        return DataProto.from_dict(tensors={"y": x * 2 + self.rank, "device": torch.full(
            (len(data),), x.device.index, device="cuda:0")})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, data):
        return DataProto.from_dict(tensors={"x": data.batch["x"].to("cuda:0") + 1})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def make(self, n):
        return torch.arange(n, dtype=torch.float32, device="cuda:0")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def total(self, x):
        return {"device": str(x.device), "sum": float(x.double().sum())}


def _group(pool, **kwargs) -> WorkerGroup:
    return WorkerGroup(pool, ClassWithInitArgs(GpuWorker), **kwargs)


def test_each_worker_sees_exactly_its_bundles_gpu_as_cuda0(gpu_cluster):
    group = _group(ResourcePool([gpu_cluster.gpus], max_colocate_count=1))
    try:
        seen = group.sees()
        by_name = {w["name"]: gpu for gpu, w in gpu_cluster.workers_of(group.name_prefix)}
        assert len({s["uuid"] for s in seen}) == gpu_cluster.gpus
        for handle, s in zip(group.workers, seen):
            gpu = by_name[handle.name]
            assert s["count"] == 1 and s["visible"] == str(gpu["index"]) and s["uuid"] == gpu["uuid"]
    finally:
        group.shutdown()


def test_three_colocated_workers_share_one_gpu_and_show_their_memory(gpu_cluster):
    pool = ResourcePool([1], max_colocate_count=3)
    groups = [_group(pool) for _ in range(3)]
    try:
        held = [g.hold(HOLD_BYTES)[0] for g in groups]
        assert len({h["uuid"] for h in held}) == 1 and len({h["pid"] for h in held}) == 3
        for g in groups:
            [(gpu, worker)] = gpu_cluster.wait_memory(g.name_prefix, HOLD_BYTES)
            assert gpu["uuid"] == held[0]["uuid"] and worker["gpu_fraction_text"] == "1/3"
            assert worker["memory_cap"] is None  # off by default
        [gpu] = {gpu["uuid"]: gpu for g in groups for gpu, _ in gpu_cluster.workers_of(g.name_prefix)}.values()
        assert gpu["memory_used_bytes"] >= 3 * HOLD_BYTES
    finally:
        for g in groups:
            g.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nccl_across_two_workers_on_two_gpus(gpu_cluster):
    if gpu_cluster.gpus < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {gpu_cluster.gpus} (the one-GPU case is the next test)")
    group = _group(ResourcePool([2], max_colocate_count=1))
    try:
        # The scheduler reserved MASTER_PORT on rank 0's node: env:// rendezvous.
        outs = podium.get(group.allreduce([("nccl", "env://")]), timeout=240)
        assert [(o["backend"], o["value"]) for o in outs] == [("nccl", 3.0)] * 2, outs
    finally:
        group.shutdown()


def test_torch_distributed_two_ranks_on_one_gpu(gpu_cluster):
    pool = ResourcePool([1], max_colocate_count=2)
    # Rendezvous on loopback whatever the host name resolves to.
    groups = [_group(pool, worker_env={"GLOO_SOCKET_IFNAME": "lo"}) for _ in range(2)]
    try:
        # Two ranks on ONE GPU: recent NCCL refuses duplicate GPUs ("Duplicate GPU
        # detected"); then gloo, which reduces CUDA tensors too. One port per attempt.
        methods = [("nccl", f"tcp://127.0.0.1:{_free_port()}"), ("gloo", f"tcp://127.0.0.1:{_free_port()}")]
        refs = [g.allreduce(methods, rank, 2) for rank, g in enumerate(groups)]
        outs = [podium.get(r, timeout=240)[0] for r in refs]
        assert outs[0]["backend"] == outs[1]["backend"], outs
        assert all(o["value"] == 3.0 and o["device"] == "cuda:0" for o in outs), outs
        print(f"two ranks on one GPU ran {outs[0]['backend']}; refused first: {outs[0]['tried']}")
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cuda_dataproto_through_a_worker_group(gpu_cluster, transport, monkeypatch):
    env = {}
    if transport == "tcp":
        # What a cross-host caller does: no shared memory, every byte over the socket.
        monkeypatch.setenv("PODIUM_DISABLE_SHM", "1")
        env["PODIUM_DISABLE_SHM"] = "1"
    world = min(gpu_cluster.gpus, 2)
    group = _group(ResourcePool([world], max_colocate_count=2), worker_env=env)
    try:
        x = torch.randn(4 * world + 1, 1 << 16, device="cuda:0").to(torch.bfloat16)  # 2 MB a rank
        data = DataProto.from_dict(tensors={"x": x}, auto_padding=True)
        out = group.double(data)
        assert len(out) == len(x)
        chunk = -(-len(x) // world)
        ranks = torch.arange(len(x), device="cuda:0") // chunk
        expected = x * 2 + ranks[:, None].to(x.dtype)
        y = out.batch["y"]
        assert y.device == torch.device("cuda:0") and torch.equal(y.view(torch.int16), expected.view(torch.int16))
        assert out.batch["device"].tolist() == [0] * len(x)  # every worker computed on its cuda:0
    finally:
        group.shutdown()


def test_cuda_future_fetched_worker_to_worker(gpu_cluster):
    pool = ResourcePool([1], max_colocate_count=2)
    producers, consumers = _group(pool), _group(pool)
    try:
        x = torch.arange(1 << 20, dtype=torch.float32)
        future = producers.produce(DataProto.from_dict(tensors={"x": x}))
        out = consumers.double(future)
        assert out.batch["y"].device.type == "cuda"
        assert torch.equal(out.batch["y"].cpu(), (x + 1) * 2)
    finally:
        producers.shutdown()
        consumers.shutdown()


def test_cuda_ipc_between_the_driver_and_a_worker(gpu_cluster):
    group = _group(ResourcePool([1], max_colocate_count=2), worker_env={cudawire.IPC_ENV: "1"})
    try:
        [made] = group.make(1 << 20)
        # Opened from the worker's handle on the same GPU (found by UUID), not copied.
        [seen] = group.sees()
        assert made.device.type == "cuda" and _uuid(made.device.index) == seen["uuid"]
        assert float(made.double().sum()) == float(sum(range(1 << 20)))
        cudawire.set_ipc(True)
        try:
            x = torch.full((1 << 20,), 2.0, device=made.device)
            [total] = group.total(x)
        finally:
            cudawire.set_ipc(None)
        assert total == {"device": "cuda:0", "sum": float(2 << 20)}
    finally:
        group.shutdown()
