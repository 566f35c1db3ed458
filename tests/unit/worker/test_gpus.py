"""GPU inventory: the fake provider, NVML with its functions patched, detection, sizes."""

from __future__ import annotations

import types

import pynvml
import pytest

from podium.errors import InvalidArgumentError
from podium.worker.agent import gpus
from podium.worker.agent.gpus import FakeProvider, Gpu, NvmlProvider, ProcessUsage, detect, fake_uuid, parse_size


# ---------------------------------------------------------------- fake provider


def test_fake_provider_reports_count_gpus_with_stable_distinct_uuids():
    provider = FakeProvider(3, 16 * 1024**3, node_id="node-a")
    got = provider.gpus()
    assert [g.index for g in got] == [0, 1, 2]
    assert all(g.memory_total_bytes == 16 * 1024**3 and g.memory_used_bytes == 0 for g in got)
    assert all(g.name == "Fake GPU" and g.uuid.startswith("GPU-") for g in got)
    assert [g.uuid for g in got] == [g.uuid for g in FakeProvider(3, node_id="node-a").gpus()]
    assert len({g.uuid for g in got} | {g.uuid for g in FakeProvider(3, node_id="node-b").gpus()}) == 6
    assert provider.processes() == []
    provider.close()
    provider.close()


@pytest.mark.parametrize("count, memory", [(-1, 1), (1, 0), (1, -5)])
def test_fake_provider_rejects_nonsense(count, memory):
    with pytest.raises(InvalidArgumentError):
        FakeProvider(count, memory)


def test_fake_uuid_depends_on_node_and_index():
    assert fake_uuid("a", 0) == fake_uuid("a", 0)
    assert len({fake_uuid("a", 0), fake_uuid("a", 1), fake_uuid("b", 0)}) == 3


# ---------------------------------------------------------------- NVML, patched


class FakeNvml:
    """Patches the pynvml functions the provider calls; ``broken`` indexes fail."""

    def __init__(self, monkeypatch, devices, *, broken_handle=(), broken_memory=(), broken_procs=()):
        self.devices = devices
        self.broken_handle, self.broken_memory, self.broken_procs = (
            set(broken_handle), set(broken_memory), set(broken_procs))
        self.shutdowns = 0

        def fail():
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

        def handle(index):
            if index in self.broken_handle:
                fail()
            return index

        def memory(h):
            if h in self.broken_memory:
                fail()
            d = self.devices[h]
            return types.SimpleNamespace(total=d["total"], used=d["used"], free=d["total"] - d["used"])

        def procs(h):
            if h in self.broken_procs:
                fail()
            return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.devices[h]["procs"]]

        def shutdown():
            self.shutdowns += 1

        for name, fn in {
            "nvmlInit": lambda: None,
            "nvmlShutdown": shutdown,
            "nvmlDeviceGetCount": lambda: len(self.devices),
            "nvmlDeviceGetHandleByIndex": handle,
            "nvmlDeviceGetUUID": lambda h: self.devices[h]["uuid"],
            "nvmlDeviceGetName": lambda h: self.devices[h]["name"],
            "nvmlDeviceGetMemoryInfo": memory,
            "nvmlDeviceGetComputeRunningProcesses": procs,
        }.items():
            monkeypatch.setattr(pynvml, name, fn)


def _devices():
    return [
        {"uuid": "GPU-aaaa", "name": b"NVIDIA H100 80GB HBM3", "total": 80, "used": 10,
         "procs": [(101, 6), (102, None)]},
        {"uuid": b"GPU-bbbb", "name": "NVIDIA H100 80GB HBM3", "total": 80, "used": 0, "procs": []},
    ]


def test_nvml_provider_reads_gpus_and_processes(monkeypatch):
    nvml = FakeNvml(monkeypatch, _devices())
    provider = NvmlProvider()
    assert provider.gpus() == [Gpu(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 80, 10),
                               Gpu(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3", 80, 0)]
    # usedGpuMemory None (hidden by the driver) reads as 0.
    assert provider.processes() == [ProcessUsage(101, "GPU-aaaa", 6), ProcessUsage(102, "GPU-aaaa", 0)]
    nvml.devices[0]["used"] = 30
    assert provider.gpus()[0].memory_used_bytes == 30
    provider.close()
    provider.close()
    assert nvml.shutdowns == 1


@pytest.mark.parametrize("broken, indices, pids", [
    ({"broken_handle": {0}}, [1], []),            # a GPU fallen off the bus is left out
    ({"broken_memory": {1}}, [0], [101, 102]),    # unreadable before its first reading: left out
    ({"broken_procs": {0}}, [0, 1], []),          # a failed process listing hides no GPU
])
def test_nvml_provider_survives_one_bad_gpu(monkeypatch, broken, indices, pids):
    FakeNvml(monkeypatch, _devices(), **broken)
    provider = NvmlProvider()
    assert [g.index for g in provider.gpus()] == indices
    assert [p.pid for p in provider.processes()] == pids


def test_nvml_provider_keeps_last_memory_reading_when_a_read_fails(monkeypatch):
    nvml = FakeNvml(monkeypatch, _devices())
    provider = NvmlProvider()
    provider.gpus()
    nvml.broken_memory.add(0)
    assert provider.gpus()[0] == Gpu(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 80, 10)


def test_detect_prefers_fake_then_nvml_then_nothing(monkeypatch):
    fake = detect(2, fake_memory_bytes=1024, node_id="n")
    assert isinstance(fake, FakeProvider) and len(fake.gpus()) == 2
    assert detect(0).gpus() == []

    FakeNvml(monkeypatch, _devices())
    assert isinstance(detect(None), NvmlProvider)

    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    none = detect(None)
    assert none.gpus() == [] and none.processes() == []


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * 1024**3),
    ("80 GiB", 80 * 1024**3),
    ("512MiB", 512 * 1024**2),
    ("1.5GB", 1_500_000_000),
    ("24gb", 24_000_000_000),
    ("1024", 1024),
    ("7B", 7),
    ("2TiB", 2 * 1024**4),
    ("16k", 16_000),
    (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80 GiBs", "-1GiB", "1e9", "eighty", -5, "1.2.3G"])
def test_parse_size_rejects(text):
    with pytest.raises(InvalidArgumentError):
        parse_size(text)


def test_default_fake_memory_is_80_gib():
    assert gpus.DEFAULT_FAKE_MEMORY == parse_size("80GiB")
