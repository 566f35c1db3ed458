"""podium.codec: bit-exact round trips of tensors, arrays, TensorDicts, DataProtos
and plain Python through every transport (bytes, chunks + Assembler, shared
memory), zero-copy where promised, and clean rejection of bad input."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from podium import codec, errors
from podium.transport import chunks
from podium.transport import shm
from podium.errors import DataLossError, InvalidArgumentError
from podium.dataproto import DataProto

# --------------------------------------------------------------------------- transports


def via_bytes(value):
    return codec.loads(codec.dumps(value))


def via_bytearray(value):
    return codec.decode(bytearray(codec.dumps(value)))


def via_chunks(value, chunk_size=chunks.CHUNK_SIZE):
    encoded = codec.encode(value)
    assembler = chunks.Assembler(encoded.nbytes, max_size=1 << 31)
    for chunk in chunks.iter_chunks(encoded.to_segments(), chunk_size):
        assembler.add(chunk)
    return codec.decode(assembler.result())


def via_small_chunks(value):
    return via_chunks(value, chunk_size=1000)


def via_shm(value):
    name, size = shm.write_segments(codec.encode(value).to_segments())
    return codec.decode(shm.read_segment(name))


TRANSPORTS = [via_bytes, via_bytearray, via_chunks, via_small_chunks, via_shm]


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's exact bits, whatever its dtype."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_tensor(got, want):
    assert type(got) is torch.Tensor
    assert got.dtype == want.dtype and got.shape == want.shape
    assert raw_bytes(got) == raw_bytes(want)


# --------------------------------------------------------------------------- tensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn]


def sample(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(24, 40, generator=gen) * 50
    if dtype == torch.bool:
        return base > 0
    if dtype == torch.complex64:
        return torch.complex(base, -base)
    if dtype.is_floating_point:
        base[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-30])
    return base.to(dtype)


SHAPES = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.T,
    "strided-slice": lambda t: t[1::3, ::2],
    "zero-size": lambda t: t[:0],
    "zero-size-inner": lambda t: t[:, :0],
    "scalar": lambda t: t[3, 5],
    "one-row": lambda t: t[7],
}


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_round_trip_is_bit_exact(dtype, transport):
    base = sample(dtype)
    for name, make in SHAPES.items():
        want = make(base)
        got = transport({"t": want})["t"]
        assert got.shape == want.shape, name
        assert_same_tensor(got, want)


# 1000-byte chunks would take 80k adds; bytes would hold three copies at once.
@pytest.mark.parametrize("transport", [via_bytearray, via_chunks, via_shm], ids=lambda f: f.__name__)
def test_large_tensor_round_trip(transport):
    want = torch.arange(20 * 1024 * 1024, dtype=torch.float32)  # 80 MiB
    got = transport(want)
    assert torch.equal(got, want)


def test_encode_does_not_copy_tensor_bytes():
    t = torch.arange(1 << 16, dtype=torch.float32)
    encoded = codec.encode(t)
    (buf,) = encoded.buffers
    assert buf.nbytes == t.numel() * 4
    assert np.frombuffer(buf, dtype=np.uint8).ctypes.data == t.data_ptr()


def test_decode_gives_writable_views_into_the_input():
    t = torch.arange(1 << 16, dtype=torch.float64)
    data = bytearray(codec.dumps(t))
    got = codec.decode(data)
    start = np.frombuffer(data, dtype=np.uint8).ctypes.data
    assert start <= got.data_ptr() < start + len(data)
    assert (got.data_ptr() - start) % codec.ALIGNMENT == 0
    got[0] = 42.0  # a view: the write lands in the received buffer
    assert torch.equal(codec.decode(data)[:2], torch.tensor([42.0, 1.0], dtype=torch.float64))


def test_read_only_input_is_copied_so_results_are_writable():
    data = codec.dumps(torch.zeros(1000))
    got = codec.decode(data)
    got += 1  # must not touch the immutable bytes object
    assert torch.equal(codec.decode(data), torch.zeros(1000))


def test_wire_layout_header_and_alignment():
    value = [torch.ones(300), np.arange(1000, dtype=np.int16), torch.ones(5, dtype=torch.uint8)]
    encoded = codec.encode(value)
    segments = encoded.to_segments()
    wire = b"".join(segments)
    assert len(wire) == encoded.nbytes == sum(s.nbytes for s in segments)
    magic, version, _, count, skeleton_len = struct.unpack_from("<4sHHIQ", wire)
    assert (magic, version, count) == (b"PDM1", 1, 2)  # the 5-byte tensor rides in-band
    for i in range(count):
        offset, length = struct.unpack_from("<QQ", wire, 20 + 16 * i)
        assert offset % 64 == 0
        assert wire[offset:offset + length] == bytes(encoded.buffers[i])
    assert skeleton_len == len(encoded.skeleton) < 1000


def test_requires_grad_is_dropped_but_parameters_keep_it():
    t = torch.ones(3, requires_grad=True) * 2
    p = torch.nn.Parameter(torch.ones(4))
    got_t, got_p = via_bytearray((t, p))
    assert not got_t.requires_grad and torch.equal(got_t, t.detach())
    assert isinstance(got_p, torch.nn.Parameter) and got_p.requires_grad
    assert torch.equal(got_p.detach(), p.detach())


def test_conjugate_and_negative_views_are_resolved():
    c = torch.complex(torch.arange(4.0), torch.ones(4))
    got = via_bytes(c.conj())
    assert torch.equal(got, c.conj().resolve_conj())


def test_same_tensor_twice_travels_once():
    t = torch.arange(10_000, dtype=torch.int32)
    encoded = codec.encode([t, t])
    assert len(encoded.buffers) == 1
    a, b = codec.decode(bytearray(b"".join(encoded.to_segments())))
    assert a is b


def test_exotic_layouts_fall_back_to_torch_reduction():
    sparse = torch.eye(4).to_sparse()
    got = via_bytes(sparse)
    assert got.is_sparse and torch.equal(got.to_dense(), torch.eye(4))


# --------------------------------------------------------------------------- numpy

ARRAYS = {
    "float64": np.linspace(0, 1, 5000),
    "int8": np.arange(-100, 100, dtype=np.int8),
    "fortran": np.asfortranarray(np.arange(600, dtype=np.float32).reshape(20, 30)),
    "strided": np.arange(10_000, dtype=np.int64)[::3],
    "2d-c": np.arange(2000, dtype=np.uint16).reshape(40, 50),
    "empty": np.zeros((0, 3)),
    "bool": np.array([True, False, True]),
    "object": np.array(["a", {"k": 1}, None, 3.5, [1, 2]], dtype=object),
    "strings": np.array(["x", "yy", "zzz"]),
}


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda f: f.__name__)
def test_numpy_round_trip(transport):
    got = transport(ARRAYS)
    for name, want in ARRAYS.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        if want.dtype == object:
            assert list(got[name]) == list(want), name
        else:
            assert np.array_equal(got[name], want), name


def test_numeric_arrays_travel_out_of_band_object_arrays_in_band():
    big = np.arange(100_000, dtype=np.float64)
    assert sum(b.nbytes for b in codec.encode(big).buffers) == big.nbytes
    objects = np.array(["s"] * 1000, dtype=object)
    assert codec.encode(objects).buffers == []


# --------------------------------------------------------------------------- containers


def jagged(lengths, offset=0):
    return torch.nested.nested_tensor([torch.arange(n) + offset for n in lengths], layout=torch.jagged)


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda f: f.__name__)
def test_tensordict_with_jagged_and_nested_tensordict(transport):
    ids = jagged([3, 1, 4, 2])
    position_ids = torch.nested.nested_tensor_from_jagged(ids.values() * 10, ids.offsets())
    td = TensorDict({
        "input_ids": ids,
        "position_ids": position_ids,
        "mask": torch.ones(4, 6, dtype=torch.bool),
        "sub": TensorDict({"x": torch.arange(8.0).reshape(4, 2)}, batch_size=[4]),
    }, batch_size=[4])
    td.set_non_tensor("note", "hello")
    got = transport(td)
    assert type(got) is TensorDict and got.batch_size == torch.Size([4])
    for key in ("input_ids", "position_ids"):
        assert got[key].is_nested and got[key].layout == torch.jagged
        assert [t.tolist() for t in got[key].unbind()] == [t.tolist() for t in td[key].unbind()]
    # The offsets are one tensor on both sides, so the ragged dims still agree.
    assert got["input_ids"].shape[1] == got["position_ids"].shape[1]
    assert torch.equal(got["mask"], td["mask"])
    assert torch.equal(got["sub", "x"], td["sub", "x"])
    assert got["note"] == "hello"


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda f: f.__name__)
def test_dataproto_round_trip(transport):
    data = DataProto.from_dict(
        tensors={"responses": torch.randint(0, 1000, (6, 16)),
                 "logp": torch.randn(6, 16).to(torch.bfloat16)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(6)], dtype=object),
                     "extra": np.array([{"i": i} for i in range(6)], dtype=object)},
        meta_info={"temperature": 0.7, "metrics": {"loss": [1.0]}},
    )
    got = transport(data)
    assert type(got) is DataProto and len(got) == 6
    for key in ("responses", "logp"):
        assert_same_tensor(got.batch[key], data.batch[key])
    assert list(got.non_tensor_batch["uid"]) == list(data.non_tensor_batch["uid"])
    assert list(got.non_tensor_batch["extra"]) == list(data.non_tensor_batch["extra"])
    assert got.meta_info == data.meta_info


def test_dataproto_tensors_travel_as_raw_buffers():
    data = DataProto.from_dict({"a": torch.zeros(64, 1024), "b": torch.zeros(64, 1024, dtype=torch.int64)})
    encoded = codec.encode(data)
    assert sum(b.nbytes for b in encoded.buffers) == 64 * 1024 * (4 + 8)
    assert len(encoded.skeleton) < 2048


def test_podium_errors_round_trip():
    cases = [
        errors.WorkerDiedError("worker 3 died", exit_code=-9, signal=9, stderr_tail="oom", rank=3, node="n1"),
        errors.InfeasibleError("no fit", node_reasons={"n1": "4 GPUs, needs 8"}),
        errors.RemoteError("boom", traceback="Traceback...", remote_type="ValueError", rank=1),
        errors.DataLossError("lost"),
    ]
    for exc in cases:
        got = via_bytes(exc)
        # (a RemoteError comes back as also its raised type: podium.errors.remote_error_class)
        assert isinstance(got, type(exc)) and type(got).__name__ == type(exc).__name__ and str(got) == str(exc)
        assert got.details == exc.details and got.rank == exc.rank and got.node == exc.node
    assert isinstance(via_bytes(cases[2]), ValueError)


@dataclasses.dataclass
class LocalPoint:
    """A class defined in this test module: a worker cannot import it."""

    x: int

    def scaled(self, k):
        return self.x * k


def local_function(v):
    return LocalPoint(v).scaled(3) + 1


def test_test_module_classes_keep_their_identity_in_process():
    got = via_bytes([LocalPoint(2), local_function])
    assert type(got[0]) is LocalPoint and got[0] == LocalPoint(2) and got[1](1) == 4


def test_test_module_objects_travel_by_value_to_another_process(tmp_path):
    payload = codec.dumps({"fn": local_function, "point": LocalPoint(5), "lam": lambda y: y * 2})
    script = ("import sys, podium.codec as c\n"
              "v = c.loads(sys.stdin.buffer.read())\n"
              "print(v['fn'](2), v['point'].scaled(2), v['lam'](21), type(v['point']).__name__)\n")
    result = subprocess.run([sys.executable, "-c", script], input=payload, capture_output=True,
                            cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == ["7", "10", "42", "LocalPoint"]


def test_importing_the_codec_does_not_import_torch():
    script = ("import sys, podium.codec, podium.transport.chunks, podium.transport.shm\n"
              "print(sorted(m for m in ('torch', 'tensordict') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip() == "[]"


def test_unpicklable_value_raises_invalid_argument():
    import threading

    with pytest.raises(InvalidArgumentError, match="cannot encode"):
        codec.encode({"lock": threading.Lock()})


# --------------------------------------------------------------------------- bad input

GOOD = codec.dumps({"t": torch.arange(1000, dtype=torch.float32), "s": "x" * 50})  # one buffer


def corrupt(offset: int, value: bytes) -> bytes:
    data = bytearray(GOOD)
    data[offset:offset + len(value)] = value
    return bytes(data)


BAD_INPUTS = {
    "empty": b"",
    "short": b"PDM1",
    "wrong-magic": b"XXXX" + GOOD[4:],
    "wrong-version": corrupt(4, struct.pack("<H", 9)),
    "huge-buffer-count": corrupt(8, struct.pack("<I", 0xFFFFFFFF)),
    "huge-skeleton": corrupt(12, struct.pack("<Q", 1 << 62)),
    "buffer-past-end": corrupt(28, struct.pack("<Q", 1 << 40)),
    "misaligned-buffer": corrupt(20, struct.pack("<Q", 65)),
    "trailing-byte": GOOD + b"\0",
    "garbage-skeleton": corrupt(36, b"\xff" * 20),
    "random": bytes(range(256)) * 4,
    "not-bytes": 12345,
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_raises_data_loss(name):
    with pytest.raises(DataLossError):
        codec.decode(BAD_INPUTS[name])


def test_every_truncation_raises_data_loss():
    for cut in range(len(GOOD)):
        with pytest.raises(DataLossError):
            codec.decode(GOOD[:cut])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_arbitrary_bytes_only_ever_raise_data_loss(blob, with_header):
    data = GOOD[:36] + blob if with_header else blob
    try:
        codec.decode(data)
    except DataLossError:
        pass


@settings(max_examples=60, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
                    | st.binary(), lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids),
                    max_leaves=20))
def test_plain_python_round_trips(value):
    assert codec.loads(codec.dumps(value)) == value


def test_code_sent_by_value_keeps_its_file_name():
    # cloudpickle would write "<dynamic-code>"; remote tracebacks must name the user's file.
    def local_function():
        return 1

    rebuilt = codec.loads(codec.dumps(local_function))
    assert rebuilt() == 1
    assert rebuilt.__code__.co_filename == __file__


def test_buffers_left_out_are_taken_from_outside_memory():
    value = {"a": torch.arange(10_000, dtype=torch.int64), "b": np.ones(5_000), "c": "text"}
    encoded = codec.encode(value)
    assert len(encoded.buffers) == 2
    rest = codec.without_buffers(encoded, {0})
    assert rest.nbytes < encoded.nbytes - 70_000
    outside = memoryview(bytearray(encoded.buffers[0]))
    got = codec.decode(b"".join(rest.to_segments()), {0: outside})
    assert torch.equal(got["a"], value["a"]) and np.array_equal(got["b"], value["b"]) and got["c"] == "text"
    got["a"][0] = 99  # a view of the outside memory, not a copy
    assert outside.cast("q")[0] == 99


@pytest.mark.parametrize("external", [{1: memoryview(bytearray(8))}, {5: memoryview(bytearray(8))}],
                         ids=["buffer-not-left-out", "no-such-buffer"])
def test_outside_memory_only_replaces_buffers_left_out(external):
    encoded = codec.encode([torch.zeros(1000), torch.zeros(1000)])
    rest = codec.without_buffers(encoded, {0})
    with pytest.raises(DataLossError, match="no empty buffer"):
        codec.decode(b"".join(rest.to_segments()), external)


@pytest.mark.parametrize("numel", [300, 4096, 1 << 20])  # in-band, a small buffer, a pooled one
def test_a_snapshot_is_the_value_when_it_was_taken(numel):
    tensor = torch.arange(numel, dtype=torch.float32)
    value = {"t": tensor, "n": 3}
    encoded = codec.encode(value)
    snap = encoded.snapshot()
    tensor += 1  # the caller changes its tensor after the call returned
    got = codec.decode(b"".join(bytes(s) for s in snap.to_segments()))
    assert torch.equal(got["t"], torch.arange(numel, dtype=torch.float32)) and got["n"] == 3
    # the encoding without a snapshot shows the change: the snapshot is what made the difference
    if encoded.buffers:
        late = codec.decode(b"".join(bytes(s) for s in encoded.to_segments()))
        assert torch.equal(late["t"], tensor)
    assert snap.nbytes == encoded.nbytes
