"""DataProto and DataProtoItem: the batch container itself.

Its methods keep verl's names and arguments; the row operations they share live in
:mod:`podium.dataproto.rows`, the conversions in :mod:`podium.dataproto.convert`, both
functions over the parts passed explicitly. Operations that return a new DataProto build
it with ``type(self)``, so subclasses stay subclasses.
"""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

from podium.dataproto.config import AUTO_PADDING_KEY, DataProtoConfig
from podium.dataproto.convert import data_info, size_message, tensordict_of, tensordict_parts
from podium.dataproto.dicts import list_of_dict_to_dict_of_list, union_numpy_dict, union_tensor_dict, union_two_dict
from podium.dataproto.rows import (Parts, chunk_parts, concat_parts, merge_meta_info, repeat_rows, repeat_rows_each,
                                   take_rows, unfold_columns)
from podium.errors import ArgumentMismatchError, InvalidArgumentAssertion, InvalidArgumentError

__all__ = ["DataProto", "DataProtoItem", "collate_fn"]


@dataclass
class DataProtoItem:
    """One row of a DataProto (what ``data[i]`` returns for an int ``i``)."""

    #: A TensorDict, or None for a batch of non-tensor columns only (Any: the type check skips tensordict).
    batch: Any = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass
class DataProto:
    """A batch: ``batch`` (TensorDict, one batch dim), ``non_tensor_batch`` (numpy
    arrays with the same rows) and ``meta_info`` (a dict shared by every row).

    Operations that return a new DataProto share ``meta_info`` by reference and
    tensors where torch indexing gives views, as in verl.
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
        raise ArgumentMismatchError(f"Indexing with {type(item)} is not supported")

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
        """Check one batch dim and that every non-tensor value is an ndarray with as many rows
        as the batch (InvalidArgumentAssertion, an AssertionError as verl's assert, if not)."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise InvalidArgumentAssertion(
                f"only support num_batch_dims=1, got batch_size {list(self.batch.batch_size)}")
        if self.non_tensor_batch is not None:
            for key, val in self.non_tensor_batch.items():
                if not isinstance(val, np.ndarray):
                    raise InvalidArgumentAssertion(
                        f"data in the non_tensor_batch must be a numpy.array with dtype=object, but for "
                        f"{key=}, got {type(val)=}")
        if self.batch is not None and self.non_tensor_batch:
            batch_size = self.batch.batch_size[0]
            for key, val in self.non_tensor_batch.items():
                if val.shape[0] != batch_size:
                    raise InvalidArgumentAssertion(
                        f"key {key} length {len(val)} is not equal to batch size {batch_size}")

    def _like(self, parts: Parts, meta_info: dict | None = None) -> DataProto:
        # A DataProto of this type from new parts, sharing meta_info unless given one.
        return type(self)(batch=parts[0], non_tensor_batch=parts[1],
                          meta_info=self.meta_info if meta_info is None else meta_info)

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
                raise InvalidArgumentError(f"Unsupported type in data {type(val)} (key {key!r}): "
                                           "a torch.Tensor or a numpy.ndarray")
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
        if num_batch_dims <= 0:
            raise InvalidArgumentAssertion(f"num_batch_dims must be greater than zero, got {num_batch_dims}")
        if non_tensors is not None and num_batch_dims != 1:
            raise InvalidArgumentAssertion(
                f"only support num_batch_dims=1 when non_tensors is not None, got {num_batch_dims}.")
        tensors = {} if tensors is None else tensors
        meta_info = {} if meta_info is None else meta_info
        non_tensors = {} if non_tensors is None else non_tensors
        if not isinstance(non_tensors, dict):
            raise InvalidArgumentAssertion(f"non_tensors must be a dict, got {type(non_tensors).__name__}")

        batch_size, pivot_key = None, None
        for key, tensor in tensors.items():
            current = tensor.shape[:num_batch_dims]
            if batch_size is None:
                batch_size, pivot_key = current, key
            elif batch_size != current:
                raise InvalidArgumentAssertion(
                    f"Not all the tensor in tensors have the same batch size with "
                    f"batch_dims={num_batch_dims}. Got {pivot_key} has {batch_size}, {key} has {current}")
        for key, val in non_tensors.items():
            if not isinstance(val, np.ndarray):
                non_tensors[key] = np.array(val, dtype=object)

        tensor_dict = TensorDict(source=tensors, batch_size=batch_size) if tensors else None
        if auto_padding:
            meta_info[AUTO_PADDING_KEY] = True
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
        return self._like(take_rows(self.batch, self.non_tensor_batch, idxs))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``[start:end:step]`` as a DataProto (what ``data[start:end]`` does)."""
        slice_obj = slice(start, end, step)
        sliced_batch = self.batch[slice_obj] if self.batch is not None else None
        return self._like((sliced_batch, {key: val[slice_obj] for key, val in self.non_tensor_batch.items()}))

    def pop(self, batch_keys: list[str] | None = None, non_tensor_batch_keys: list[str] | None = None,
            meta_info_keys: list[str] | None = None) -> DataProto:
        """Remove the given keys from self and return them as a new DataProto. Nothing is
        removed when a key is missing (InvalidArgumentAssertion naming it)."""
        batch_keys, non_tensor_batch_keys, meta_info_keys = (
            list(batch_keys or []), list(non_tensor_batch_keys or []), list(meta_info_keys or []))
        for part, keys, present in (("batch", batch_keys, self.batch.keys() if batch_keys else ()),
                                    ("non_tensor_batch", non_tensor_batch_keys, self.non_tensor_batch),
                                    ("meta_info", meta_info_keys, self.meta_info)):
            missing = [key for key in keys if key not in present]
            if missing:
                raise InvalidArgumentAssertion(f"cannot pop {missing} from {part}: it holds {list(present)}")
        tensors = {key: self.batch.pop(key) for key in batch_keys}
        non_tensors = {key: self.non_tensor_batch.pop(key) for key in non_tensor_batch_keys}
        meta_info = {key: self.meta_info.pop(key) for key in meta_info_keys}
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)

    def rename(self, old_keys: str | list[str] | None = None,
               new_keys: str | list[str] | None = None) -> DataProto:
        """Rename batch keys (in place; only ``batch``); returns self."""

        def as_list(keys: Any) -> list[str]:
            if isinstance(keys, str):
                return [keys]
            if isinstance(keys, list):
                return keys
            raise ArgumentMismatchError(f"keys must be a list or a string, but got {type(keys)}")

        old_keys, new_keys = as_list(old_keys), as_list(new_keys)
        if len(new_keys) != len(old_keys):
            raise InvalidArgumentError(f"new_keys and old_keys must have the same length, but got "
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
        if not isinstance(mini_batch_size, (int, np.integer)) or mini_batch_size < 1:
            raise InvalidArgumentError(f"mini_batch_size must be a positive int, got {mini_batch_size!r}")
        if self.batch.batch_size[0] % mini_batch_size != 0:
            raise InvalidArgumentAssertion(f"{self.batch.batch_size[0]} % {mini_batch_size} != 0")
        dataloader_kwargs = {} if dataloader_kwargs is None else dataloader_kwargs
        if not isinstance(dataloader_kwargs, dict):
            raise InvalidArgumentAssertion(f"dataloader_kwargs must be a dict, got {type(dataloader_kwargs).__name__}")
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
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
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False)) or DataProtoConfig.auto_padding

    def _padded_parts(self, padding_size: int, padding_candidate: str) -> Parts:
        # Self's rows, then padding_size copies of its last (or first) row.
        if len(self) == 0:
            raise InvalidArgumentError(f"cannot pad an empty DataProto with {padding_size} rows")
        row = self.select_idxs([0 if padding_candidate == "first" else len(self) - 1])
        extra = row.repeat(padding_size)
        return concat_parts([self.batch, extra.batch], [self.non_tensor_batch, extra.non_tensor_batch])

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the last row (the first with
        ``padding_candidate="first"``) IN PLACE, as verl does. Prefer :meth:`padded`."""
        if padding_size == 0:
            return
        self.batch, self.non_tensor_batch = self._padded_parts(padding_size, padding_candidate)

    def padded(self, padding_size: int, padding_candidate: str = "") -> DataProto:
        """A new DataProto with ``padding_size`` copies of the last (or first) row
        appended; self is not touched. ``meta_info`` is a shallow copy."""
        if padding_size == 0:
            return self._like((self.batch, dict(self.non_tensor_batch)), dict(self.meta_info))
        return self._like(self._padded_parts(padding_size, padding_candidate), dict(self.meta_info))

    # ----------------------------------------------------------------- split / join

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` pieces along the rows; each shares meta_info.

        Without padding enabled the length must divide by ``chunks``. With padding
        enabled uneven pieces follow ``torch.chunk`` (e.g. 10 rows in 4 -> 3,3,3,1).
        """
        if not isinstance(chunks, (int, np.integer)) or chunks < 1:
            raise InvalidArgumentError(f"chunks must be a positive int, got {chunks!r}")
        if not self.is_padding_enabled() and len(self) % chunks != 0:
            raise InvalidArgumentAssertion(
                f"only support equal chunk. Got size of DataProto {len(self)} and chunk {chunks}.")
        return [self._like(parts) for parts in chunk_parts(self.batch, self.non_tensor_batch, int(chunks))]

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
            raise InvalidArgumentError("DataProto.concat needs at least one DataProto, got an empty list")
        batch, non_tensor = concat_parts([d.batch for d in data], [d.non_tensor_batch for d in data])
        merged = merge_meta_info([d.meta_info for d in data])
        return type(data[0])(batch=batch, non_tensor_batch=non_tensor, meta_info=merged)

    def reorder(self, indices: torch.Tensor) -> None:
        """Permute the rows by ``indices`` (in place)."""
        indices_np = indices.detach().cpu().numpy()
        if self.batch is not None:
            self.batch = self.batch[indices]
        self.non_tensor_batch = {key: val[indices_np] for key, val in self.non_tensor_batch.items()}

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``aabb`` with interleave, else ``abab``."""
        return self._like(repeat_rows(self.batch, self.non_tensor_batch, repeat_times, interleave))

    def sample_level_repeat(self, repeat_times: list[int] | tuple | np.ndarray | torch.Tensor) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times."""
        return self._like(repeat_rows_each(self.batch, self.non_tensor_batch, repeat_times))

    def unfold_column_chunks(self, n_split: int, split_keys: list[str] | None = None) -> DataProto:
        """Split each column in ``split_keys`` along dim 1 into ``n_split`` pieces and move
        them to the batch dim (row ``i`` becomes rows ``i*n .. i*n+n-1``); every other
        column is repeated ``n_split`` times row by row to match.

        Unlike verl, no keys means every non-tensor column is repeated (verl fails with
        ``TypeError`` there), and a column whose second dimension ``n_split`` does not
        divide raises InvalidArgumentError naming it (verl: a reshape error)."""
        return self._like(unfold_columns(self.batch, self.non_tensor_batch, n_split, split_keys))

    # ----------------------------------------------------------------- conversions and files

    def to_tensordict(self) -> Any:
        """One TensorDict: tensors as they are, each non-tensor column as a ``NonTensorStack``
        (one entry per row), each ``meta_info`` entry as ``NonTensorData``. A key in more
        than one part is refused with InvalidArgumentError (verl: an assert)."""
        return tensordict_of(self.batch, self.non_tensor_batch, self.meta_info, len(self))

    @classmethod
    def from_tensordict(cls, tensor_dict: Any, meta_info: dict | None = None,
                        num_batch_dims: int = 1) -> DataProto:
        """The inverse of :meth:`to_tensordict`: ``NonTensorStack`` entries become object
        columns, ``NonTensorData`` entries ``meta_info``, tensors the batch."""
        tensors, non_tensors, meta = tensordict_parts(tensor_dict, meta_info)
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta,
                             num_batch_dims=num_batch_dims)

    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Write this DataProto to ``filepath`` (a pickle, as verl's)."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike) -> DataProto:
        """Read what :meth:`save_to_disk` wrote. It unpickles, as verl's does: only load
        files you trust."""
        with open(filepath, "rb") as f:
            return pickle.load(f)  # noqa: S301 - verl's format; documented as trusted-only

    def get_data_info(self) -> str:
        """A multi-line summary: each tensor's shape, dtype and device, each non-tensor
        column's shape and dtype (and the element types of object columns), each
        ``meta_info`` entry's type."""
        return data_info(self.batch, self.non_tensor_batch, self.meta_info)

    def print_size(self, prefix: str = "") -> None:
        """Print the batch's and the non-tensor columns' sizes in GB (verl's message)."""
        message = size_message(self.batch, self.non_tensor_batch)
        print(f"{prefix}, {message}" if prefix else message)


def collate_fn(x: list[DataProtoItem]) -> DataProto:
    """Stack DataProtoItems back into a DataProto (the DataLoader collate of make_iterator)."""
    batch = torch.stack([d.batch for d in x]).contiguous()
    non_tensor_batch: dict[str, Any] = list_of_dict_to_dict_of_list([d.non_tensor_batch for d in x])
    for key, val in non_tensor_batch.items():
        non_tensor_batch[key] = np.array(val, dtype=object)
    return DataProto(batch=batch, non_tensor_batch=non_tensor_batch)
