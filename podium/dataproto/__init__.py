"""DataProto: the batch container of verl's single controller, compatible with
``verl.protocol`` (names, arguments and behaviour).

A :class:`DataProto` holds ``batch`` (a TensorDict with one batch dimension),
``non_tensor_batch`` (numpy arrays, usually ``dtype=object``, with the same
number of rows) and ``meta_info`` (a plain dict). Worker groups split it into
chunks for the ranks and concatenate what the ranks return.

The package, lowest first: :mod:`~podium.dataproto.config` (the global switches),
:mod:`~podium.dataproto.dicts` (verl's dict helpers), :mod:`~podium.dataproto.rows` and
:mod:`~podium.dataproto.convert` (row operations and conversions, functions over the parts),
:mod:`~podium.dataproto.container` (the class) and :mod:`~podium.dataproto.padding`.
Every name verl code imports from ``verl.protocol`` is importable from here.

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
* Where verl asserts, the check raises :class:`~podium.errors.InvalidArgumentAssertion`
  with the numbers (an ``AssertionError`` too, so verl code that catches one still does);
  where verl raises ``ValueError``, an :class:`~podium.errors.InvalidArgumentError`.
* Padding helpers keep ``meta_info`` as it is instead of running it through the
  ``metrics`` merge of :meth:`DataProto.concat` (which would duplicate metrics).
* ``unfold_column_chunks(n)`` with no keys repeats every non-tensor column, and
  ``to_tensordict`` refuses a key that is in two parts (InvalidArgumentError, verl: an assert).
* ``load_from_disk`` reads pickles, as verl's does: only load files you trust.
"""

from __future__ import annotations

from podium.dataproto.config import PADDING_SIZE_KEY, DataProtoConfig
from podium.dataproto.container import DataProto, DataProtoItem, collate_fn
from podium.dataproto.dicts import list_of_dict_to_dict_of_list, union_numpy_dict, union_tensor_dict, union_two_dict
from podium.dataproto.padding import pad_dataproto_to_divisor, unpad_dataproto

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

#: verl's private name of :data:`PADDING_SIZE_KEY`, which verl code imports.
_padding_size_key = PADDING_SIZE_KEY

