"""DataProto: the batch container of verl's single controller, compatible with
``verl.protocol`` (names, arguments and behaviour).

A :class:`DataProto` holds ``batch`` (a TensorDict with one batch dimension),
``non_tensor_batch`` (numpy arrays, usually ``dtype=object``, with the same
number of rows) and ``meta_info`` (a plain dict). Worker groups split it into
chunks for the ranks and concatenate what the ranks return.

Deliberate differences from verl, all where verl would fail or surprise:

* :meth:`DataProto.padded` returns a padded copy and leaves the caller's object
  alone (verl's :meth:`DataProto.padding`, kept as is, pads in place).
* Pickling carries the batch as a plain dict of tensors plus its batch size,
  not ``torch.save`` bytes, so :mod:`podium.codec` moves the tensors as raw
  buffers.
* :meth:`DataProto.concat` of an empty list, padding of an empty DataProto and
  a chunk count torch cannot honour raise errors that say so; ``metrics`` dicts
  with different keys are merged instead of failing an assert; meta_info values
  that are arrays or tensors are compared element-wise.
* Padding helpers keep ``meta_info`` as it is instead of running it through the
  ``metrics`` merge of :meth:`DataProto.concat` (which would duplicate metrics).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import torch
from tensordict import TensorDict

__all__ = [
    "DataProto",
    "DataProtoItem",
    "DataProtoConfig",
    "PADDING_SIZE_KEY",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "union_tensor_dict",
    "union_numpy_dict",
    "union_two_dict",
    "list_of_dict_to_dict_of_list",
    "collate_fn",
]

logger = logging.getLogger(__name__)

#: The kwarg the dispatcher uses to pass the padding size to the collector
#: (verl's ``_padding_size_key``; the value is verl's).
PADDING_SIZE_KEY = "_padding_size_key_x123d"
_padding_size_key = PADDING_SIZE_KEY


class _DataProtoConfigMeta(type):
    """Makes ``DataProtoConfig.auto_padding`` a class-level property."""

    _config: dict[str, bool] = {}
    auto_padding_key = "_verl_auto_padding"

    @property
    def auto_padding(cls) -> bool:
        """True when auto-padding is on for every DataProto (class flag or env)."""
        by_env = os.getenv("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")
        return by_env or cls._config.get(cls.auto_padding_key, False)

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        assert isinstance(enabled, bool), f"enabled must be a boolean, got {enabled} as {type(enabled)}"
        cls._config[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Global DataProto switches: ``DataProtoConfig.auto_padding = True`` turns on
    auto-padding for every DataProto (as does env ``VERL_AUTO_PADDING=1|true``)."""


# --------------------------------------------------------------------------- helpers
# (verl's module-level names, kept importable from here)

from podium.dataproto_dicts import (_values_equal, list_of_dict_to_dict_of_list,  # noqa: E402
                                    union_numpy_dict, union_tensor_dict, union_two_dict)
from podium.dataproto_io import DataProtoIO  # noqa: E402
from podium.rowcat import cat_tensordicts  # noqa: E402
from podium.dataproto_padding import (_concat_rows, collate_fn, pad_dataproto_to_divisor,  # noqa: E402
                                      unpad_dataproto)


# --------------------------------------------------------------------------- DataProto


@dataclass
class DataProtoItem:
    """One row of a DataProto (what ``data[i]`` returns for an int ``i``)."""

    #: A TensorDict, or None for a batch of non-tensor columns only (Any: the type check skips tensordict).
    batch: Any = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass
class DataProto(DataProtoIO):
    """A batch: ``batch`` (TensorDict, one batch dim), ``non_tensor_batch`` (numpy
    arrays with the same rows) and ``meta_info`` (a dict shared by every row).

    Operations that return a new DataProto share ``meta_info`` by reference and
    tensors where torch indexing gives views, as in verl. Conversions, files and
    inspection (``to_tensordict``, ``save_to_disk``, ``get_data_info``, ...) come from
    :class:`podium.dataproto_io.DataProtoIO`.
    """

    #: A TensorDict, or None for a batch of non-tensor columns only (Any: the type check skips tensordict).
    batch: Any = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check_consistency()

    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.batch_size[0]
        if self.non_tensor_batch:
            return next(iter(self.non_tensor_batch.values())).shape[0]
        return 0

    @overload
    def __getitem__(self, item: int | np.integer) -> DataProtoItem: ...

    @overload
    def __getitem__(self, item: slice | list | np.ndarray | torch.Tensor) -> DataProto: ...

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """slice -> DataProto; list / ndarray / Tensor of ints or bools -> DataProto
        (:meth:`select_idxs`); int -> :class:`DataProtoItem`."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)):
            tensor_data = self.batch[item] if self.batch is not None else None
            non_tensor_data = {key: val[item] for key, val in self.non_tensor_batch.items()}
            return DataProtoItem(batch=tensor_data, non_tensor_batch=non_tensor_data,
                                 meta_info=self.meta_info)
        raise TypeError(f"Indexing with {type(item)} is not supported")

    def __getstate__(self) -> dict[str, Any]:
        # The batch as a plain dict of tensors (nested TensorDicts stay
        # TensorDicts; the codec reduces those too), never torch.save bytes.
        batch = None
        if self.batch is not None:
            batch = (dict(self.batch.items()), tuple(self.batch.batch_size))
        return {"batch": batch, "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state: dict[str, Any]) -> None:
        batch = state["batch"]
        self.batch = TensorDict(batch[0], batch_size=batch[1]) if batch is not None else None
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def check_consistency(self) -> None:
        """Assert one batch dim and that every non-tensor value is an ndarray with
        as many rows as the batch."""
        if self.batch is not None:
            assert len(self.batch.batch_size) == 1, "only support num_batch_dims=1"
        if self.non_tensor_batch is not None:
            for key, val in self.non_tensor_batch.items():
                assert isinstance(val, np.ndarray), (
                    f"data in the non_tensor_batch must be a numpy.array with dtype=object, but for "
                    f"{key=}, got {type(val)=}")
        if self.batch is not None and self.non_tensor_batch:
            batch_size = self.batch.batch_size[0]
            for key, val in self.non_tensor_batch.items():
                assert val.shape[0] == batch_size, (
                    f"key {key} length {len(val)} is not equal to batch size {batch_size}")

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_single_dict(cls, data: dict[str, torch.Tensor | np.ndarray], meta_info: dict | None = None,
                         auto_padding: bool = False) -> DataProto:
        """Build from one dict, tensors going to ``batch`` and arrays to ``non_tensor_batch``."""
        tensors, non_tensors = {}, {}
        for key, val in data.items():
            if isinstance(val, torch.Tensor):
                tensors[key] = val
            elif isinstance(val, np.ndarray):
                non_tensors[key] = val
            else:
                raise ValueError(f"Unsupported type in data {type(val)}")
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info,
                             auto_padding=auto_padding)

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor] | None = None, non_tensors: dict | None = None,
                  meta_info: dict | None = None, num_batch_dims: int = 1,
                  auto_padding: bool = False) -> DataProto:
        """Build from tensors sharing their first ``num_batch_dims`` dims, plus
        non-tensors (anything not an ndarray becomes an object array).

        ``auto_padding=True`` sets ``meta_info["_verl_auto_padding"]``.
        """
        assert num_batch_dims > 0, "num_batch_dims must be greater than zero"
        if non_tensors is not None:
            assert num_batch_dims == 1, "only support num_batch_dims=1 when non_tensors is not None."
        tensors = {} if tensors is None else tensors
        meta_info = {} if meta_info is None else meta_info
        non_tensors = {} if non_tensors is None else non_tensors
        assert isinstance(non_tensors, dict)

        batch_size, pivot_key = None, None
        for key, tensor in tensors.items():
            current = tensor.shape[:num_batch_dims]
            if batch_size is None:
                batch_size, pivot_key = current, key
            else:
                assert batch_size == current, (
                    f"Not all the tensor in tensors have the same batch size with "
                    f"batch_dims={num_batch_dims}. Got {pivot_key} has {batch_size}, {key} has {current}")
        for key, val in non_tensors.items():
            if not isinstance(val, np.ndarray):
                non_tensors[key] = np.array(val, dtype=object)

        tensor_dict = TensorDict(source=tensors, batch_size=batch_size) if tensors else None
        if auto_padding:
            meta_info[DataProtoConfig.auto_padding_key] = True
        return cls(batch=tensor_dict, non_tensor_batch=non_tensors, meta_info=meta_info)

    # ----------------------------------------------------------------- selection

    def to(self, device: str | torch.device) -> DataProto:
        """Move the batch to ``device`` (in place); returns self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def select(self, batch_keys: list[str] | None = None, non_tensor_batch_keys: list[str] | None = None,
               meta_info_keys: list[str] | None = None, deepcopy: bool = False) -> DataProto:
        """A DataProto with only the given keys (None: all of that part)."""
        sub_batch = self.batch.select(*tuple(batch_keys)) if batch_keys is not None else self.batch
        if non_tensor_batch_keys is not None:
            non_tensor_batch = {k: v for k, v in self.non_tensor_batch.items() if k in non_tensor_batch_keys}
        else:
            non_tensor_batch = self.non_tensor_batch
        if meta_info_keys is not None:
            sub_meta_info = {k: v for k, v in self.meta_info.items() if k in meta_info_keys}
        else:
            sub_meta_info = self.meta_info
        if deepcopy:
            non_tensor_batch = copy.deepcopy(non_tensor_batch)
            sub_meta_info = copy.deepcopy(sub_meta_info)
        return type(self)(batch=sub_batch, non_tensor_batch=non_tensor_batch, meta_info=sub_meta_info)

    def select_idxs(self, idxs: list | np.ndarray | torch.Tensor) -> DataProto:
        """The rows at ``idxs`` (integer indices or a boolean mask)."""
        if isinstance(idxs, list):
            idxs = torch.tensor(idxs)
            if idxs.dtype != torch.bool:
                idxs = idxs.type(torch.int64)
        if isinstance(idxs, np.ndarray):
            idxs_np, idxs_torch = idxs, torch.from_numpy(idxs)
        else:
            idxs_torch, idxs_np = idxs, idxs.detach().cpu().numpy()
        batch_size = int(idxs_np.sum()) if idxs_np.dtype == bool else idxs_np.shape[0]
        selected_batch = None
        if self.batch is not None:
            selected_batch = TensorDict(source={key: t[idxs_torch] for key, t in self.batch.items()},
                                        batch_size=(batch_size,), device=self.batch.device)
        selected_non_tensor = {key: val[idxs_np] for key, val in self.non_tensor_batch.items()}
        return type(self)(batch=selected_batch, non_tensor_batch=selected_non_tensor, meta_info=self.meta_info)

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``[start:end:step]`` as a DataProto (what ``data[start:end]`` does)."""
        slice_obj = slice(start, end, step)
        sliced_batch = self.batch[slice_obj] if self.batch is not None else None
        sliced_non_tensor = {key: val[slice_obj] for key, val in self.non_tensor_batch.items()}
        return type(self)(batch=sliced_batch, non_tensor_batch=sliced_non_tensor, meta_info=self.meta_info)

    def pop(self, batch_keys: list[str] | None = None, non_tensor_batch_keys: list[str] | None = None,
            meta_info_keys: list[str] | None = None) -> DataProto:
        """Remove the given keys from self and return them as a new DataProto."""
        tensors = {}
        for key in batch_keys or []:
            assert key in self.batch.keys()
            tensors[key] = self.batch.pop(key)
        non_tensors = {}
        for key in non_tensor_batch_keys or []:
            assert key in self.non_tensor_batch.keys()
            non_tensors[key] = self.non_tensor_batch.pop(key)
        meta_info = {}
        for key in meta_info_keys or []:
            assert key in self.meta_info.keys()
            meta_info[key] = self.meta_info.pop(key)
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)

    def rename(self, old_keys: str | list[str] | None = None,
               new_keys: str | list[str] | None = None) -> DataProto:
        """Rename batch keys (in place; only ``batch``); returns self."""

        def as_list(keys: Any) -> list[str]:
            if isinstance(keys, str):
                return [keys]
            if isinstance(keys, list):
                return keys
            raise TypeError(f"keys must be a list or a string, but got {type(keys)}")

        old_keys, new_keys = as_list(old_keys), as_list(new_keys)
        if len(new_keys) != len(old_keys):
            raise ValueError(f"new_keys and old_keys must have the same length, but got "
                             f"{len(new_keys)} and {len(old_keys)}")
        self.batch.rename_key_(tuple(old_keys), tuple(new_keys))
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other`` into self (in place) and return self; shared keys must agree
        and batch sizes match."""
        self.batch = union_tensor_dict(self.batch, other.batch)
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        self.meta_info = union_two_dict(self.meta_info, other.meta_info)
        return self

    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      dataloader_kwargs: dict | None = None) -> Iterator[DataProto]:
        """Yield mini-batches of ``mini_batch_size`` rows for ``epochs`` epochs
        (a torch DataLoader over the rows; ``dataloader_kwargs`` go to it, e.g.
        ``{"shuffle": True}``). Each mini-batch carries this meta_info."""
        assert self.batch.batch_size[0] % mini_batch_size == 0, (
            f"{self.batch.batch_size[0]} % {mini_batch_size} != 0")
        dataloader_kwargs = {} if dataloader_kwargs is None else dataloader_kwargs
        assert isinstance(dataloader_kwargs, dict)
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        from torch.utils.data import DataLoader

        loader = DataLoader(dataset=self, batch_size=mini_batch_size, collate_fn=collate_fn,
                            generator=generator, **dataloader_kwargs)

        def get_data() -> Iterator[DataProto]:
            for _ in range(epochs):
                for d in loader:
                    d.meta_info = self.meta_info
                    yield d

        return iter(get_data())

    # ----------------------------------------------------------------- padding

    def is_padding_enabled(self) -> bool:
        """Whether auto-padding applies: ``meta_info["_verl_auto_padding"]``, the
        class flag ``DataProtoConfig.auto_padding`` or env ``VERL_AUTO_PADDING``."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or \
            DataProtoConfig.auto_padding

    def _padding_part(self, padding_size: int, padding_candidate: str) -> DataProto:
        if len(self) == 0:
            raise ValueError(f"cannot pad an empty DataProto with {padding_size} rows")
        row = self.select_idxs([0 if padding_candidate == "first" else len(self) - 1])
        return row.repeat(padding_size)

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the last row (the first with
        ``padding_candidate="first"``) IN PLACE, as verl does. Prefer :meth:`padded`."""
        if padding_size == 0:
            return
        padded = _concat_rows([self, self._padding_part(padding_size, padding_candidate)], self.meta_info)
        self.batch = padded.batch
        self.non_tensor_batch = padded.non_tensor_batch

    def padded(self, padding_size: int, padding_candidate: str = "") -> DataProto:
        """A new DataProto with ``padding_size`` copies of the last (or first) row
        appended; self is not touched. ``meta_info`` is a shallow copy."""
        if padding_size == 0:
            return type(self)(batch=self.batch, non_tensor_batch=dict(self.non_tensor_batch),
                              meta_info=dict(self.meta_info))
        return _concat_rows([self, self._padding_part(padding_size, padding_candidate)],
                            dict(self.meta_info))

    # ----------------------------------------------------------------- split / join

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` pieces along the rows; each shares meta_info.

        Without padding enabled the length must divide by ``chunks``. With padding
        enabled uneven pieces follow ``torch.chunk`` (e.g. 10 rows in 4 -> 3,3,3,1).
        """
        if not self.is_padding_enabled():
            assert len(self) % chunks == 0, (
                f"only support equal chunk. Got size of DataProto {len(self)} and chunk {chunks}.")
        bsz_in_batch = None
        if self.batch is not None:
            batch_lst = list(self.batch.chunk(chunks=chunks, dim=0))
            assert len(batch_lst) == chunks, (
                f"cannot split {len(self)} rows into {chunks} chunks (torch.chunk makes "
                f"{len(batch_lst)}); pad to a multiple of {chunks} first")
            bsz_in_batch = np.array([b.batch_size[0] for b in batch_lst])
            chunk_indices = np.cumsum(bsz_in_batch)[:-1]
        else:
            batch_lst = [None] * chunks
        non_tensor_batch_lst: list[dict[str, np.ndarray]] = [{} for _ in range(chunks)]
        for key, val in self.non_tensor_batch.items():
            assert isinstance(val, np.ndarray)
            if bsz_in_batch is not None:
                parts = np.array_split(val, chunk_indices.tolist())
            else:
                parts = np.array_split(val, chunks)
            assert len(parts) == chunks
            for i in range(chunks):
                non_tensor_batch_lst[i][key] = parts[i]
        return [type(self)(batch=batch_lst[i], non_tensor_batch=non_tensor_batch_lst[i],
                           meta_info=self.meta_info) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Pieces of ``split_size`` rows (the last may be shorter)."""
        return [self[i:i + split_size] for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Concatenate along the rows.

        meta_info: keys other than ``metrics`` are merged and must agree
        (``AssertionError("Conflicting values for meta_info key 'k'")``); every
        part's ``metrics`` (a dict, or a list of dicts) is gathered into one
        dict of lists. The result has the type of ``data[0]``.
        """
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        batches = [d.batch for d in data]
        new_batch = cat_tensordicts(batches) if batches[0] is not None else None
        non_tensor_batch: dict[str, Any] = list_of_dict_to_dict_of_list([d.non_tensor_batch for d in data])
        for key, val in non_tensor_batch.items():
            non_tensor_batch[key] = np.concatenate(val, axis=0)

        merged: dict[str, Any] = {}
        all_metrics: list[dict] = []
        for d in data:
            for key, val in d.meta_info.items():
                if key == "metrics":
                    if isinstance(val, list):
                        all_metrics.extend(val)
                    elif val is not None:
                        all_metrics.append(val)
                elif key in merged:
                    assert _values_equal(merged[key], val), f"Conflicting values for meta_info key '{key}'"
                else:
                    merged[key] = val
        if all_metrics:
            merged["metrics"] = list_of_dict_to_dict_of_list(all_metrics)
        return type(data[0])(batch=new_batch, non_tensor_batch=non_tensor_batch, meta_info=merged)

    def reorder(self, indices: torch.Tensor) -> None:
        """Permute the rows by ``indices`` (in place)."""
        indices_np = indices.detach().cpu().numpy()
        if self.batch is not None:
            self.batch = self.batch[indices]
        self.non_tensor_batch = {key: val[indices_np] for key, val in self.non_tensor_batch.items()}

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``aabb`` with interleave, else ``abab``."""
        repeated_batch = None
        if self.batch is not None:
            if interleave:
                tensors = {key: t.repeat_interleave(repeat_times, dim=0) for key, t in self.batch.items()}
            else:
                tensors = {key: t.unsqueeze(0).expand(repeat_times, *t.shape).reshape(-1, *t.shape[1:])
                           for key, t in self.batch.items()}
            repeated_batch = TensorDict(source=tensors, batch_size=(self.batch.batch_size[0] * repeat_times,),
                                        device=self.batch.device)
        repeated_non_tensor = {}
        for key, val in self.non_tensor_batch.items():
            if interleave:
                repeated_non_tensor[key] = np.repeat(val, repeat_times, axis=0)
            else:
                repeated_non_tensor[key] = np.tile(val, (repeat_times,) + (1,) * (val.ndim - 1))
        return type(self)(batch=repeated_batch, non_tensor_batch=repeated_non_tensor, meta_info=self.meta_info)

    def sample_level_repeat(self, repeat_times: list[int] | tuple | np.ndarray | torch.Tensor) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times."""
        if isinstance(repeat_times, (torch.Tensor, np.ndarray)):
            assert len(repeat_times.shape) == 1
            repeat_times = repeat_times.tolist()
        repeat_times = list(repeat_times)
        counts = torch.tensor(repeat_times)
        repeated_batch = None
        if self.batch is not None:
            tensors = {key: t.repeat_interleave(counts, dim=0) for key, t in self.batch.items()}
            repeated_batch = TensorDict(source=tensors, batch_size=(int(counts.sum().item()),),
                                        device=self.batch.device)
        repeated_non_tensor = {key: np.repeat(val, repeat_times, axis=0)
                               for key, val in self.non_tensor_batch.items()}
        return type(self)(batch=repeated_batch, non_tensor_batch=repeated_non_tensor, meta_info=self.meta_info)

