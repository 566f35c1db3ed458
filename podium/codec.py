"""The one place that turns Python values into bytes and back.

Values are pickled with protocol 5 and out-of-band buffers: a torch tensor or a
numpy array contributes a *raw buffer* (its bytes, exactly as they lie in
memory) and only a tiny reference to it goes into the pickled *skeleton*. Tensor
bytes are therefore never re-encoded element by element, and neither encode nor
decode copies them (a non-contiguous tensor is made contiguous once; a CUDA
tensor is moved to the CPU once).

Wire form (all integers little-endian)::

    offset 0   magic  b"PDM1"
           4   u16    version (1)
           6   u16    flags (0, reserved)
           8   u32    number of buffers N
          12   u64    skeleton length S
          20   N x (u64 offset, u64 length)   where each buffer lies, absolute
      20+16N   skeleton (S bytes)
               zero padding, then buffer 0 at a 64-byte aligned offset,
               zero padding, then buffer 1 at a 64-byte aligned offset, ...

The payload ends exactly where the last buffer (or the skeleton) ends.
:func:`decode` checks every length against the input before it reads anything,
so garbage, truncated or padded input raises :class:`~podium.errors.DataLossError`
and never allocates more than the input's own size.

What round-trips and how:

* ``torch.Tensor`` (and ``nn.Parameter``): dtype, shape and the raw bytes of the
  contiguous tensor, for every dtype (bfloat16, float8, bool, complex...), bit
  exact. ``requires_grad`` and autograd history are dropped (a received tensor is
  a fresh leaf; a ``Parameter`` keeps its flag). A CUDA tensor is made contiguous on
  its device and copied to the host once; it arrives on the receiver's ``cuda:0`` when
  the receiver has CUDA, else on the CPU (``PODIUM_CUDA_RECEIVE=cpu`` keeps it there;
  ``PODIUM_CUDA_IPC=1`` sends IPC handles instead, same host only: see
  :mod:`podium.cudawire`). Other non-CPU tensors arrive on the CPU. Jagged nested
  tensors (``layout=torch.jagged``) travel as their values/offsets/lengths
  components; other exotic layouts (sparse, quantized, strided nested, meta) fall
  back to torch's own reduction.
* ``numpy.ndarray``: protocol-5 out-of-band natively; object arrays hold Python
  objects and are pickled in-band.
* ``tensordict.TensorDict``: a plain dict of its entries (nested TensorDicts
  recursively) plus batch size, so its tensors move as raw buffers too.
* verl's own ``verl.protocol.DataProto``: its batch (a TensorDict, as above),
  ``non_tensor_batch`` and ``meta_info``. verl's ``__getstate__`` would ``torch.save``
  the batch into one in-band bytes object (a copy each way); this keeps its tensors
  raw buffers, as Podium's own ``podium.dataproto.DataProto`` does through its
  ``__getstate__``.
* Functions and classes defined in ``__main__`` or in a test module
  (``test_*.py``, ``*_test.py``, ``conftest.py``) are pickled *by value* with
  cloudpickle, since the receiving process cannot import them; everything else
  importable is pickled by reference.

Decoded tensors and arrays are zero-copy, *writable* views into the input when
it is writable (a ``bytearray``, a writable ``memoryview`` or ``mmap``); the
views keep the input alive. Read-only input (``bytes``) is copied once into a
``bytearray`` first, because callers (verl workers) mutate received batches in
place.

Security: decoding is unpickling, which runs code named by the payload.
Decode only bytes from an authenticated peer (the cluster token is checked by
the RPC layer before any payload reaches this module).

``import podium.codec`` does not import torch, tensordict or numpy: they are
only looked up in ``sys.modules`` (a value cannot hold a tensor unless torch is
already imported), so the node agent stays free of torch.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from podium import cudawire
from podium.errors import DataLossError, InvalidArgumentError
from podium.memorypool import MIN_POOLED_BYTES, POOL, copy_segments

__all__ = ["MAGIC", "VERSION", "ALIGNMENT", "Encoded", "encode", "decode", "without_buffers", "dumps", "loads",
           "pinned_by_value"]

#: First four bytes of every payload.
MAGIC = b"PDM1"
#: Wire-form version written in the header.
VERSION = 1
#: Every out-of-band buffer starts at a multiple of this many bytes.
ALIGNMENT = 64

_HEADER = struct.Struct("<4sHHIQ")
_ENTRY = struct.Struct("<QQ")
_ZEROS = memoryview(bytes(ALIGNMENT))

# Tensors this small travel in-band (as a bytearray, so they decode writable):
# an out-of-band entry costs 16 bytes of table plus up to 63 bytes of padding.
_INLINE_MAX = 1024

_TEST_FILE_SUFFIXES = ("_test.py",)


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass
class Encoded:
    """A value ready for the wire: a small pickled skeleton plus raw buffers."""

    skeleton: bytes
    buffers: list[memoryview] = field(default_factory=list)  # raw, each C-contiguous, in order

    def _layout(self) -> tuple[list[tuple[int, int]], int, int]:
        """(offset, length) of each buffer, where the skeleton starts, the total size."""
        skeleton_at = _HEADER.size + _ENTRY.size * len(self.buffers)
        end = skeleton_at + len(self.skeleton)
        entries = []
        for buf in self.buffers:
            offset = _align(end)
            entries.append((offset, buf.nbytes))
            end = offset + buf.nbytes
        return entries, skeleton_at, end

    @property
    def nbytes(self) -> int:
        """Total size of the wire form (the sum of :meth:`to_segments`)."""
        return self._layout()[2]

    def snapshot(self) -> "Encoded":
        """The same value with its buffers copied into memory of its own.

        A value is encoded without copying its tensors, so until it is sent, a change to
        them changes what goes out. A call that returns before its arguments are sent
        (``blocking=False``, tasks, actor methods, ``put``) sends a snapshot instead: the
        argument as it was when the call returned, as Ray's serialization at call time
        gives. Large buffers are copied into one reused mapping of :mod:`podium.memorypool`
        (fresh pages cost more than the copy), which goes back to the pool when the last
        view of it is dropped.
        """
        total = sum(buf.nbytes for buf in self.buffers)
        if not total:
            return self
        if total < MIN_POOLED_BYTES:
            return Encoded(self.skeleton, [memoryview(bytes(buf)) for buf in self.buffers])
        target = self.pooled_target()
        copy_segments(target.buffers[0].obj, self.buffers)  # the copies are one mapping, in order
        return target

    def pooled_target(self) -> "Encoded":
        """The same skeleton with buffers of the same sizes in one reused mapping of
        :mod:`podium.memorypool`, back to back in order, not filled yet: where
        :meth:`snapshot` copies to (:mod:`podium.transport.copyonsend` copies there while
        sending). Only for buffers of at least ``MIN_POOLED_BYTES`` in all."""
        total = sum(buf.nbytes for buf in self.buffers)
        view = POOL.lease(POOL.take(total), total)
        copies, at = [], 0
        for buf in self.buffers:
            copies.append(view[at:at + buf.nbytes])
            at += buf.nbytes
        return Encoded(self.skeleton, copies)

    def to_segments(self) -> list[memoryview]:
        """Header, skeleton, padding and buffers: concatenated, they are the wire form.

        The buffers are the tensors' own memory, so nothing large is copied here;
        keep the segments (or this object) alive until they are sent.
        """
        entries, _, _ = self._layout()
        header = bytearray(_HEADER.pack(MAGIC, VERSION, 0, len(self.buffers), len(self.skeleton)))
        for offset, length in entries:
            header += _ENTRY.pack(offset, length)
        segments = [memoryview(header), memoryview(self.skeleton)]
        end = len(header) + len(self.skeleton)
        for (offset, length), buf in zip(entries, self.buffers):
            if offset > end:
                segments.append(_ZEROS[: offset - end])
            if length:
                segments.append(buf)
            end = offset + length
        return segments


def encode(value: Any) -> Encoded:
    """Pickle ``value`` into a skeleton plus raw out-of-band buffers (no tensor copy).

    Raises InvalidArgumentError when the value cannot be pickled.
    """
    raw: list[memoryview] = []

    def keep(pb: pickle.PickleBuffer) -> None:
        raw.append(pb.raw())

    out = io.BytesIO()
    try:
        _Pickler(out, protocol=5, buffer_callback=keep).dump(value)
    except InvalidArgumentError:
        raise
    except Exception as exc:  # pickling user objects can raise anything
        where = _unpicklable_part(value)
        raise InvalidArgumentError(f"cannot encode a value of type {type(value).__name__}{where}: "
                                   f"{type(exc).__name__}: {exc}") from exc
    return Encoded(skeleton=out.getvalue(), buffers=raw)


def _unpicklable_part(value: Any, path: str = "", depth: int = 0) -> str:
    """", at [0][1] (a Lock)": where in nested tuples, lists and dicts pickling fails.

    Only called once encoding failed, so the extra pickling costs nothing on success."""
    if depth > 4:
        return ""
    if isinstance(value, dict):
        items = [(f"[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (tuple, list)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    else:
        items = []
    for key, item in items:
        try:
            _Pickler(io.BytesIO(), protocol=5, buffer_callback=lambda pb: None).dump(item)
        except Exception:  # noqa: BLE001 - this is the part that fails: look deeper
            return _unpicklable_part(item, path + key, depth + 1) or f", at {path + key} (a {type(item).__name__})"
    return ""


def decode(data: bytes | bytearray | memoryview, external: dict[int, memoryview] | None = None) -> Any:
    """Rebuild a value from its wire form (see the module docstring).

    Tensors and arrays are views into ``data`` when it is writable (no copy);
    read-only input is copied once. Raises DataLossError for anything that is not
    a complete, well-formed payload, and also when unpickling fails (e.g. a class
    this process cannot import; the original exception is chained as
    ``__cause__``). Unsafe on untrusted input (it unpickles): authenticate the
    sender first.

    ``external`` maps buffer indexes to memory that holds those buffers instead of the
    payload (whose entries for them are empty): a result written in place into memory the
    receiver already has (see :func:`without_buffers`). The views are used as they are.
    """
    kind = type(data)
    if (kind is bytes or kind is bytearray) and len(data) <= _COMMON_MAX and not external:
        # Most calls carry no arguments, most replies are None. (bytes() of a bytes is itself.)
        common = _COMMON.get(bytes(data))
        if common is not None:
            return common()
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise DataLossError(f"payload must be bytes-like, got {type(data).__name__}") from exc
    if view.ndim != 1 or view.itemsize != 1:
        if not view.contiguous:
            raise DataLossError("payload buffer is not contiguous")
        view = view.cast("B")
    size = view.nbytes
    if size < _HEADER.size:
        raise DataLossError(f"payload too short: {size} bytes, the header alone is {_HEADER.size}")
    magic, version, _flags, count, skeleton_len = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise DataLossError(f"not a Podium payload (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise DataLossError(f"unsupported payload version {version} (this side speaks {VERSION})")
    skeleton_at = _HEADER.size + _ENTRY.size * count
    if skeleton_at > size or skeleton_len > size - skeleton_at:
        raise DataLossError(f"payload truncated: header announces {count} buffers and a "
                            f"{skeleton_len}-byte skeleton, but only {size} bytes arrived")
    entries = []
    end = skeleton_at + skeleton_len
    for i in range(count):
        offset, length = _ENTRY.unpack_from(view, _HEADER.size + _ENTRY.size * i)
        if offset != _align(end) or offset > size or length > size - offset:
            raise DataLossError(f"payload truncated or corrupt: buffer {i} at {offset} "
                                f"(+{length}) in a {size}-byte payload")
        entries.append((offset, length))
        end = offset + length
    if end != size:
        raise DataLossError(f"payload size mismatch: header describes {end} bytes, got {size}")
    if view.readonly:
        # Receivers mutate batches in place (verl workers do), so hand out
        # writable memory: one copy of read-only input.
        view = memoryview(bytearray(view))
    buffers = [view[offset:offset + length] for offset, length in entries]
    if external:
        for index, outside in external.items():
            if not 0 <= index < count or entries[index][1]:
                raise DataLossError(f"payload has no empty buffer {index} to take from outside "
                                    f"(it has {count} buffers)")
            buffers[index] = outside
    try:
        return pickle.loads(view[skeleton_at:skeleton_at + skeleton_len], buffers=buffers)
    except Exception as exc:  # garbage skeletons raise anything
        raise DataLossError(f"cannot decode payload: {type(exc).__name__}: {exc}") from exc


# The wire forms of the values most calls carry, decoded without unpickling: a no-op call's
# arguments and its None result are most of a fan-out's decoding (filled in at import).
_COMMON: dict[bytes, Any] = {}
_COMMON_MAX = 0


def _common_value(value: Any, fresh: Any) -> None:
    """``decode`` of ``value``'s wire form returns ``fresh()`` (a new object each time)."""
    global _COMMON_MAX
    wire = dumps(value)
    _COMMON[wire] = fresh
    _COMMON_MAX = max(_COMMON_MAX, len(wire))


def without_buffers(encoded: Encoded, indexes: set[int]) -> Encoded:
    """``encoded`` with the buffers at ``indexes`` left empty: the receiver supplies them
    (``decode(..., external=...)``) from memory it already holds."""
    empty = memoryview(b"")
    return Encoded(encoded.skeleton, [empty if i in indexes else buf for i, buf in enumerate(encoded.buffers)])


def dumps(value: Any) -> bytes:
    """The wire form of ``value`` as one bytes object (copies; prefer :func:`encode`)."""
    return b"".join(encode(value).to_segments())


def loads(data: bytes | bytearray | memoryview) -> Any:
    """Same as :func:`decode`."""
    return decode(data)


# --------------------------------------------------------------------------- pickling


class _Pickler(cloudpickle.Pickler):
    """cloudpickle plus raw-buffer reductions for tensors, arrays and TensorDicts."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            reduced = _reduce_tensor(torch, obj)
            if reduced is not NotImplemented:
                return reduced
        np = sys.modules.get("numpy")
        if (np is not None and type(obj) is np.ndarray and not obj.dtype.hasobject
                and not (obj.flags.c_contiguous or obj.flags.f_contiguous)):
            # numpy would pickle a strided array in-band (a copy inside the
            # skeleton); one contiguous copy keeps its bytes out of band.
            return np.ascontiguousarray, (np.ascontiguousarray(obj),)
        tensordict = sys.modules.get("tensordict")
        if tensordict is not None and type(obj) is getattr(tensordict, "TensorDict", None):
            return _reduce_tensordict(obj)
        verl_protocol = sys.modules.get("verl.protocol")
        if verl_protocol is not None and type(obj) is getattr(verl_protocol, "DataProto", None):
            return _rebuild_verl_dataproto, (obj.batch, obj.non_tensor_batch, obj.meta_info)
        if isinstance(obj, (types.FunctionType, type)):
            _register_test_module_by_value(getattr(obj, "__module__", None))
        if isinstance(obj, types.CodeType):
            return _reduce_code(obj)
        return super().reducer_override(obj)


_DYNAMIC_FILENAME = "<dynamic-code>"


def _reduce_code(code: types.CodeType) -> Any:
    # cloudpickle writes every by-value code object's file name as "<dynamic-code>",
    # so a remote traceback of a class sent by value would name no file and show no
    # source. Keep the real name: the worker's traceback then points at the user's
    # file and line (with the source line where the file exists there too).
    rebuild, args = cloudpickle.cloudpickle._code_reduce(code)
    return rebuild, tuple(code.co_filename if arg == _DYNAMIC_FILENAME else arg for arg in args)


_checked_modules: set[str] = set()


def _is_test_module(module: types.ModuleType) -> bool:
    name = os.path.basename(getattr(module, "__file__", None) or "")
    return (name.startswith("test_") and name.endswith(".py")) or name.endswith(_TEST_FILE_SUFFIXES) \
        or name == "conftest.py"


#: Test modules this codec registered by value, for good (see pinned_by_value).
_pinned_modules: set[str] = set()


def _register_test_module_by_value(module_name: str | None) -> None:
    # Test modules are importable here (pytest put them on sys.path) but not in
    # a worker process, so their functions and classes must travel by value.
    if not module_name or module_name in _checked_modules:
        return
    _checked_modules.add(module_name)
    module = sys.modules.get(module_name)
    if module is not None and module_name != "__main__" and _is_test_module(module):
        _pinned_modules.add(module_name)
        cloudpickle.register_pickle_by_value(module)


def pinned_by_value(module_name: str) -> bool:
    """True when the codec registered module ``module_name`` to pickle by value for good (a
    test module: importable here, not in a worker). :func:`podium.worker.factory.by_value`
    leaves such a module registered when it is done with it."""
    return module_name in _pinned_modules


def _reduce_tensor(torch: Any, tensor: Any) -> Any:
    is_parameter = type(tensor) is torch.nn.Parameter
    if tensor.is_nested and tensor.layout == torch.jagged:
        lengths = tensor.lengths()
        return _rebuild_jagged, (tensor.values(), tensor.offsets(), lengths,
                                 tensor._ragged_idx)
    if type(tensor) is not torch.Tensor and not is_parameter:
        return NotImplemented  # another subclass: let its own reduction decide
    if (tensor.layout != torch.strided or tensor.is_nested or tensor.is_quantized
            or tensor.device.type == "meta"):
        return NotImplemented
    requires_grad = tensor.requires_grad if is_parameter else False
    # Contiguous (and conj/neg resolved) where the tensor lies, so a CUDA tensor crosses
    # to the host in one copy of exactly the bytes that travel.
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous()
    device = None
    if flat.device.type == "cuda":
        device = "cuda"
        if cudawire.ipc_enabled():
            return cudawire.reduce_ipc(torch, flat if not is_parameter else tensor)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    dtype = str(flat.dtype).removeprefix("torch.")
    shape = tuple(flat.shape)
    if flat.numel() == 0:
        data: Any = None
    else:
        raw = flat.reshape(-1).view(torch.uint8).numpy()
        if raw.nbytes <= _INLINE_MAX:
            data = bytearray(raw.data)
        else:
            data = pickle.PickleBuffer(raw)
    if device is not None:
        return _rebuild_tensor, (dtype, shape, data, is_parameter, requires_grad, device)
    return _rebuild_tensor, (dtype, shape, data, is_parameter, requires_grad)


def _rebuild_tensor(dtype_name: str, shape: tuple[int, ...], data: Any, is_parameter: bool = False,
                    requires_grad: bool = False, device: str | None = None) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    if data is None:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        raw = torch.frombuffer(data, dtype=torch.uint8)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if raw.data_ptr() % itemsize:
            raw = raw.clone()  # misaligned input (an odd slice): copy rather than fault
        tensor = raw.view(dtype).view(shape)
    if device == "cuda":
        tensor = cudawire.to_receiver(tensor)
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor


def _rebuild_jagged(values: Any, offsets: Any, lengths: Any, ragged_idx: int) -> Any:
    import torch

    return torch.nested.nested_tensor_from_jagged(values, offsets, lengths, jagged_dim=ragged_idx)


def _reduce_tensordict(td: Any) -> Any:
    # Only the entries and the batch size: TensorDict's own pickling is generic
    # and would not take the tensors' raw-buffer path. A CUDA TensorDict is rebuilt
    # where its tensors arrive (cuda:0 or the CPU); other non-CPU devices are dropped.
    entries = dict(td.items())
    device = td.device
    device_name = str(device) if device is not None and device.type in ("cpu", "cuda") else None
    return _rebuild_tensordict, (entries, tuple(td.batch_size), device_name)


def _rebuild_tensordict(entries: dict[str, Any], batch_size: tuple[int, ...], device: str | None) -> Any:
    from tensordict import TensorDict

    if device is not None and device.startswith("cuda"):
        device = "cuda:0" if cudawire.receive_on_cuda() else None
    return TensorDict(entries, batch_size=batch_size, device=device)


def _rebuild_verl_dataproto(batch: Any, non_tensor_batch: dict, meta_info: dict) -> Any:
    from verl.protocol import DataProto

    # Not through __init__: its consistency check already passed where the value was made.
    out = DataProto.__new__(DataProto)
    out.batch, out.non_tensor_batch, out.meta_info = batch, non_tensor_batch, meta_info
    return out


_common_value(None, lambda: None)
_common_value(((), {}), lambda: ((), {}))
