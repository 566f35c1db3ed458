"""CUDA tensors through the codec on a real GPU: copied to the host once, arriving on
cuda:0 bit-exact (or on the CPU with PODIUM_CUDA_RECEIVE=cpu), TensorDict and DataProto
included; CUDA IPC handles opened by another process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from tensordict import TensorDict

from podium import codec, cudawire
from podium.dataproto import DataProto

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@pytest.fixture(autouse=True)
def _switches(monkeypatch):
    monkeypatch.delenv(cudawire.RECEIVE_ENV, raising=False)
    monkeypatch.delenv(cudawire.IPC_ENV, raising=False)
    cudawire.set_ipc(None)
    yield
    cudawire.set_ipc(None)


def _make(dtype: torch.dtype, shape=(513, 129)) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, device="cuda:0") > 0.5
    return (torch.randn(shape, device="cuda:0") * 40).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_tensor_round_trips_to_cuda0_bit_exact(dtype):
    x = _make(dtype)
    encoded = codec.encode(x)
    # Moved to the host once: one raw buffer of exactly the tensor's bytes, in host memory.
    assert [b.nbytes for b in encoded.buffers] == [x.numel() * x.element_size()]
    out = codec.decode(b"".join(encoded.to_segments()))
    assert out.device == torch.device("cuda:0") and _same_bits(out, x)


def test_non_contiguous_conj_and_parameter():
    x = torch.randn(300, 200, device="cuda:0")
    for view in (x.t(), x[::3, 1::2], torch.randn(64, 64, dtype=torch.complex64, device="cuda:0").conj()):
        out = codec.decode(codec.dumps(view))
        assert out.device.type == "cuda" and out.is_contiguous() and _same_bits(out, view.resolve_conj())
    p = torch.nn.Parameter(torch.randn(1000, device="cuda:0"))
    out = codec.decode(codec.dumps(p))
    assert isinstance(out, torch.nn.Parameter) and out.requires_grad and out.device.type == "cuda"
    assert _same_bits(out, p)


def test_receive_on_cpu_when_asked(monkeypatch):
    monkeypatch.setenv(cudawire.RECEIVE_ENV, "cpu")
    x = _make(torch.bfloat16)
    out = codec.decode(codec.dumps(x))
    assert out.device.type == "cpu" and _same_bits(out, x)


def test_tensordict_and_dataproto_on_cuda():
    td = TensorDict({"a": _make(torch.float32, (64, 8)), "b": {"c": _make(torch.int64, (64,))}},
                    batch_size=[64], device="cuda:0")
    out = codec.decode(codec.dumps(td))
    assert out.device == torch.device("cuda:0") and _same_bits(out["b", "c"], td["b", "c"])
    data = DataProto.from_dict(tensors={"x": _make(torch.float16, (32, 16))}, non_tensors={"id": list(range(32))})
    back = codec.decode(codec.dumps(data))
    assert back.batch["x"].device.type == "cuda" and _same_bits(back.batch["x"], data.batch["x"])
    assert list(back.non_tensor_batch["id"]) == list(range(32))


_CHILD = textwrap.dedent("""
    import sys, torch
    from podium import codec
    data = sys.stdin.buffer.read()
    x = codec.decode(data)
    assert x.device.type == "cuda", x.device
    print(repr(float(x.double().sum())), x.dtype, flush=True)
""")


def test_ipc_handle_is_opened_by_another_process():
    cudawire.set_ipc(True)
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
    payload = codec.dumps(x)
    # A handle, not the bytes: the payload is tiny.
    assert len(payload) < 4096
    # The child sees the same GPUs; the handle's GPU is found there by UUID.
    child = subprocess.run([sys.executable, "-c", _CHILD], input=payload, capture_output=True, timeout=90)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    total, dtype = child.stdout.decode().split()
    assert float(total) == float(x.double().sum()) and dtype == "torch.float32"
    del x
    torch.cuda.ipc_collect()
