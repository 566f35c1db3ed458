"""CUDA tensors on the wire, the parts that run without a GPU: the device tag a CUDA tensor
travels with, where a tagged tensor lands in a process without CUDA (the CPU, bit-exact),
PODIUM_CUDA_RECEIVE / PODIUM_CUDA_IPC switches, and the IPC rebuild refusing a process that
cannot open the handle. The GPU side is tests/gpu/test_cuda_codec.py."""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import TensorDict

from podium import codec, cudawire
from podium.errors import DataLossError


class _AsSentFromCuda:
    """Reduces exactly as the codec reduces a CUDA tensor (bytes plus the "cuda" tag), so
    the receiving half is exercised on a machine that cannot make a CUDA tensor."""

    def __init__(self, tensor: torch.Tensor, parameter: bool = False) -> None:
        self.tensor, self.parameter = tensor, parameter

    def __reduce__(self):
        raw = self.tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        dtype = str(self.tensor.dtype).removeprefix("torch.")
        return codec._rebuild_tensor, (dtype, tuple(self.tensor.shape), pickle.PickleBuffer(raw),
                                       self.parameter, self.parameter, "cuda")


@pytest.fixture(autouse=True)
def _fresh_switches(monkeypatch):
    monkeypatch.delenv(cudawire.RECEIVE_ENV, raising=False)
    monkeypatch.delenv(cudawire.IPC_ENV, raising=False)
    cudawire.set_ipc(None)
    yield
    cudawire.set_ipc(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool,
                                   torch.int64, torch.complex64, torch.uint8])
def test_a_tagged_tensor_arrives_on_the_cpu_bit_exact_without_cuda(dtype):
    assert not torch.cuda.is_available()
    source = (torch.randn(257, 33) * 50).to(dtype) if dtype != torch.bool else torch.rand(257, 33) > 0.5
    out = codec.decode(codec.dumps({"x": _AsSentFromCuda(source)}))["x"]
    assert out.device.type == "cpu" and out.dtype == dtype and out.shape == source.shape
    assert torch.equal(out.view(torch.uint8), source.view(torch.uint8))


def test_a_tagged_parameter_keeps_its_flag():
    out = codec.decode(codec.dumps(_AsSentFromCuda(torch.ones(600), parameter=True)))
    assert isinstance(out, torch.nn.Parameter) and out.requires_grad and out.device.type == "cpu"


def test_payloads_without_the_tag_still_decode():
    # The five-argument form older senders write (CPU tensors still use it).
    reduced = codec._Pickler.reducer_override(codec._Pickler(__import__("io").BytesIO()), torch.arange(300))
    assert reduced[0] is codec._rebuild_tensor and len(reduced[1]) == 5
    assert torch.equal(codec.decode(codec.dumps(torch.arange(300))), torch.arange(300))


def test_receive_policy(monkeypatch):
    monkeypatch.setattr(cudawire, "_has_cuda", True)
    assert cudawire.receive_on_cuda()
    monkeypatch.setenv(cudawire.RECEIVE_ENV, "cpu")
    assert not cudawire.receive_on_cuda()
    monkeypatch.setenv(cudawire.RECEIVE_ENV, "auto")
    monkeypatch.setattr(cudawire, "_has_cuda", None)
    assert cudawire.receive_on_cuda() is torch.cuda.is_available()


def test_ipc_switch(monkeypatch):
    assert not cudawire.ipc_enabled()
    monkeypatch.setenv(cudawire.IPC_ENV, "1")
    assert cudawire.ipc_enabled()
    cudawire.set_ipc(False)
    assert not cudawire.ipc_enabled()
    cudawire.set_ipc(None)
    monkeypatch.setenv(cudawire.IPC_ENV, "0")
    assert not cudawire.ipc_enabled()


def test_cpu_tensors_ignore_the_ipc_switch():
    cudawire.set_ipc(True)
    x = torch.randn(1000)
    assert torch.equal(codec.decode(codec.dumps(x)), x)


def test_an_ipc_tensor_in_a_process_without_cuda_is_a_clear_data_loss():
    payload = codec.dumps(_IpcFromElsewhere())
    with pytest.raises(DataLossError, match="GPU-0000.*without CUDA"):
        codec.decode(payload)


class _IpcFromElsewhere:
    def __reduce__(self):
        return cudawire.rebuild_ipc, ("GPU-0000", None, ())


def test_a_cuda_tensordict_is_rebuilt_where_its_tensors_land():
    class CudaTd:
        def __reduce__(self):
            return codec._rebuild_tensordict, ({"a": _AsSentFromCuda(torch.arange(500.))}, (500,), "cuda:0")

    td = codec.decode(codec.dumps(CudaTd()))
    assert isinstance(td, TensorDict) and td.device is None and td["a"].device.type == "cpu"
    assert torch.equal(td["a"], torch.arange(500.))
