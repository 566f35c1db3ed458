"""Dispatch and collect functions: how one WorkerGroup call is split over ranks and stitched back.

This is verl's ``single_controller/base/decorator.py`` registry, controller side. A
*dispatch function* ``dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)`` turns
the caller's arguments into per-rank arguments (lists of length ``world_size`` that the
execute step slices, see :func:`slice_for_ranks`); a *collect function*
``collect_fn(worker_group, outputs) -> result`` turns the per-rank outputs back into one
value. ``DISPATCH_MODE_FN_REGISTRY`` maps every predefined :class:`~podium.worker.Dispatch`
member to its pair; custom modes are added with :func:`register_dispatch_mode`.

Where Podium deliberately differs from verl (each fixes one of verl's sharp edges; see
docs/dispatch.md):

* ``Dispatch.RANK_ZERO`` has no dispatch function in verl either, but verl only fails with
  a bare ``KeyError`` while binding. :func:`get_predefined_dispatch_fn` raises
  :class:`~podium.errors.RankZeroDispatchError` (an ``InvalidArgumentError``, also a
  ``KeyError``) that says to use ``Execute.RANK_ZERO``.
* verl's checks are ``assert`` statements (gone under ``python -O``, a bare
  ``AssertionError``). Each check here is an explicit test that raises
  :class:`~podium.errors.InvalidArgumentAssertion` with the numbers: an
  ``InvalidArgumentError`` that ``except AssertionError`` (as verl code writes) still catches.
* ``DP_COMPUTE`` accepts tuples and slices them like lists (verl sends the whole tuple to
  every rank).
* Auto-padding never mutates the caller's DataProto: ranks receive chunks of a padded copy.
* ``DP_COMPUTE_METRIC``: padding is removed by dropping only the metrics of ranks whose
  chunk was pure padding (verl drops the last ``pad`` workers' metrics, real rows included).
* nd-mesh dispatch collects in data-parallel order (verl: global-rank order, which permutes
  rows when dp ranks do not increase with rank), keeps one collector per dp rank, works with
  keyword-only calls, and replicates non-data arguments instead of asserting.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

from tensordict import TensorDict

from podium.controller.dispatch.data import chunk as _chunk
from podium.controller.dispatch.data import concat as _concat
from podium.controller.dispatch.data import concat_tensordict, split_tensordict
from podium.controller.dispatch.data import is_data as _is_data
from podium.controller.dispatch.data import is_proto as _is_proto
from podium.controller.dispatch.data import padded_copy as _padded_copy
from podium.controller.dispatch.data import looks_like_ref as _looks_like_ref
from podium.dataproto import PADDING_SIZE_KEY
from podium.errors import InvalidArgumentAssertion, RankZeroDispatchError, UnimplementedError
from podium.refs import DataProtoFuture
from podium.worker.decorator import Dispatch, Execute

__all__ = [
    "DISPATCH_MODE_FN_REGISTRY",
    "PADDED_ROWS_KEY",
    "PADDING_SIZE_KEY",
    "collect_all_to_all",
    "collect_dp_compute",
    "collect_dp_compute_data_proto",
    "collect_lazy_compute_data_proto",
    "collect_nd_compute",
    "concat_tensordict",
    "dispatch_all_to_all",
    "dispatch_direct_rollout_fn",
    "dispatch_dp_compute",
    "dispatch_dp_compute_data_proto",
    "dispatch_dp_compute_data_proto_with_func",
    "dispatch_lazy_compute_data_proto",
    "dispatch_nd_compute",
    "dispatch_one_to_all",
    "get_predefined_dispatch_fn",
    "get_predefined_execute_fn",
    "make_nd_compute_dataproto_dispatch_fn",
    "register_dispatch_mode",
    "resolve_dispatch_mode",
    "slice_for_ranks",
    "split_tensordict",
    "unpad_output",
    "update_dispatch_mode",
]

#: Podium's companion of PADDING_SIZE_KEY: the padded row count, so that per-rank outputs
#: (DP_COMPUTE_METRIC) can be trimmed by which ranks held real rows.
PADDED_ROWS_KEY = "_podium_padded_rows_x123d"


# ---------------------------------------------------------------------------------------
# predefined dispatch / collect functions (verl names)


def dispatch_one_to_all(worker_group, *args, **kwargs):
    """Every rank gets the same value: each argument becomes ``[value] * world_size``."""
    ws = worker_group.world_size
    args = tuple([arg] * ws for arg in args)
    kwargs = {k: [v] * ws for k, v in kwargs.items()}
    return args, kwargs


def dispatch_all_to_all(worker_group, *args, **kwargs):
    """Arguments unchanged; the execute step's slicing rule decides what each rank gets."""
    return args, kwargs


def collect_all_to_all(worker_group, output):
    """The list of per-rank outputs, in rank order."""
    return output


def dispatch_direct_rollout_fn(worker_group, *args, **kwargs):
    """Forbidden, as in verl: direct rollout methods are called on the workers themselves."""
    raise UnimplementedError("Direct rollout call is forbidden: call a DIRECT_ROLLOUT_METHOD on the workers "
                             "themselves (verl's rule)")


def collect_direct_rollout_fn(worker_group, output):
    """Forbidden, as in verl."""
    raise UnimplementedError("Direct rollout call is forbidden: call a DIRECT_ROLLOUT_METHOD on the workers "
                             "themselves (verl's rule)")


def dispatch_dp_compute(worker_group, *args, **kwargs):
    """Each argument must be a list or tuple of ``world_size`` items; rank i gets item i.

    Podium differs: tuples are sliced like lists (verl passes the assert, then sends the
    whole tuple to every rank because its slicing rule only slices lists).
    """
    ws = worker_group.world_size
    for arg in list(args) + list(kwargs.values()):
        if not isinstance(arg, (tuple, list)) or len(arg) != ws:
            raise InvalidArgumentAssertion(
                f"DP_COMPUTE needs every argument to be a list or tuple of world_size={ws} "
                f"items, got {type(arg).__name__}"
                + (f" of length {len(arg)}" if isinstance(arg, (tuple, list)) else ""))
    args = tuple(list(arg) for arg in args)
    kwargs = {k: list(v) for k, v in kwargs.items()}
    return args, kwargs


def collect_dp_compute(worker_group, output):
    """The list of per-rank outputs (must have ``world_size`` entries)."""
    if len(output) != worker_group.world_size:
        raise InvalidArgumentAssertion(f"DP_COMPUTE collects one output per rank: expected "
                                       f"{worker_group.world_size} outputs, got {len(output)}")
    return output


def _split_args_kwargs_data_proto(chunks: int, *args, **kwargs):
    """Chunk every DataProto/TensorDict/DataProtoFuture argument into ``chunks`` parts."""
    return (tuple(_chunk(arg, chunks) for arg in args),
            {k: _chunk(v, chunks) for k, v in kwargs.items()})


def _split_args_kwargs_data_proto_with_auto_padding(chunks: int, *args, **kwargs):
    """Pad padding-enabled DataProtos to a multiple of ``chunks`` (on copies), then chunk.

    Returns ``(args, kwargs)`` where kwargs also carries ``PADDING_SIZE_KEY`` (and
    ``PADDED_ROWS_KEY``) when some argument had padding enabled, as verl does.
    """
    data_len = None
    padding_size = None

    def pad_and_chunk(value):
        nonlocal data_len, padding_size
        if _is_proto(value) and value.is_padding_enabled():
            if data_len is None:
                data_len = len(value)
                padding_size = (chunks - data_len % chunks) if data_len % chunks else 0
            elif len(value) != data_len:
                raise InvalidArgumentAssertion(
                    f"padding-enabled DataProtos must have the same length: {data_len} != {len(value)} rows")
            if padding_size:
                value = _padded_copy(value, padding_size)
        return _chunk(value, chunks)

    split_args = tuple(pad_and_chunk(arg) for arg in args)
    split_kwargs = {k: pad_and_chunk(v) for k, v in kwargs.items()}
    if padding_size is not None:
        split_kwargs[PADDING_SIZE_KEY] = padding_size
        split_kwargs[PADDED_ROWS_KEY] = data_len + padding_size
    return split_args, split_kwargs


def _check_data_args(mode: str, args, kwargs) -> None:
    for arg in list(args) + list(kwargs.values()):
        if not _is_data(arg):
            raise InvalidArgumentAssertion(
                f"{mode} needs DataProto, TensorDict or DataProtoFuture arguments, "
                f"got {type(arg).__name__}")


def dispatch_dp_compute_data_proto(worker_group, *args, **kwargs):
    """Chunk every data argument into ``world_size`` parts (auto-padding a copy if enabled)."""
    _check_data_args("DP_COMPUTE_PROTO", args, kwargs)
    return _split_args_kwargs_data_proto_with_auto_padding(worker_group.world_size, *args, **kwargs)


def dispatch_dp_compute_data_proto_with_func(worker_group, *args, **kwargs):
    """``args[0]`` is a function replicated to every rank; the rest is chunked (no padding)."""
    if not args or not callable(args[0]):
        raise InvalidArgumentAssertion(
            "DP_COMPUTE_PROTO_WITH_FUNC needs a function as its first argument, got "
            + (type(args[0]).__name__ if args else "no arguments"))
    _check_data_args("DP_COMPUTE_PROTO_WITH_FUNC", args[1:], kwargs)
    ws = worker_group.world_size
    split_args, split_kwargs = _split_args_kwargs_data_proto(ws, *args[1:], **kwargs)
    return ([args[0]] * ws,) + split_args, split_kwargs


def collect_dp_compute_data_proto(worker_group, output):
    """Concatenate per-rank DataProtos (or TensorDicts); refs become a DataProtoFuture."""
    for value in output:
        if not (_is_data(value) or _looks_like_ref(value)):
            raise InvalidArgumentAssertion(f"expected DataProto outputs from every rank, got "
                                           f"{type(value).__name__}")
    if len(output) == 1 and _is_proto(output[0]) and "metrics" not in output[0].meta_info:
        # One rank: its reply was decoded for this call alone, so it is the result as is
        # (concat would copy every tensor once more; it only reshapes "metrics").
        return output[0]
    return _concat(list(output))


# ---------------------------------------------------------------------------------------
# nd-mesh dispatch


def _mesh_info(worker_group, attr: str, query: str, mesh_name: str) -> list:
    cache = getattr(worker_group, attr, None)
    if cache is None:
        cache = {}
        setattr(worker_group, attr, cache)
    if mesh_name not in cache:
        info = list(getattr(worker_group, query)(mesh_name))
        if len(info) != worker_group.world_size:
            raise InvalidArgumentAssertion(
                f"{query}({mesh_name!r}) returned {len(info)} entries for world_size "
                f"{worker_group.world_size}")
        cache[mesh_name] = info
    return cache[mesh_name]


def dispatch_nd_compute(dp_rank_mapping: list[int], dp_size: int, worker_group, *args, **kwargs):
    """Rank i gets chunk ``dp_rank_mapping[i]`` of each data argument (no padding).

    Ranks that share a dp rank receive the very same chunk object, so the execute step
    encodes it once and sends those bytes to each of them. Non-data arguments are
    replicated (verl asserts instead).
    """
    def fan_out(value):
        if _is_data(value):
            parts = _chunk(value, dp_size)
            if len(parts) != dp_size:
                raise InvalidArgumentAssertion(f"could not split {type(value).__name__} into {dp_size} parts "
                                               f"(got {len(parts)})")
            return [parts[d] for d in dp_rank_mapping]
        return [value] * len(dp_rank_mapping)

    return (tuple(fan_out(a) for a in args), {k: fan_out(v) for k, v in kwargs.items()})


def collect_nd_compute(collect_mask: list[bool], dp_rank_mapping: list[int] | None, worker_group, output):
    """Outputs of the collecting ranks, ordered by dp rank (one per dp rank)."""
    if len(output) != worker_group.world_size:
        raise InvalidArgumentAssertion(f"mesh collect needs one output per rank: expected "
                                       f"{worker_group.world_size} outputs, got {len(output)}")
    chosen: dict[int, Any] = {}
    for rank, (keep, value) in enumerate(zip(collect_mask, output)):
        if not keep:
            continue
        dp = dp_rank_mapping[rank] if dp_rank_mapping is not None else rank
        chosen.setdefault(dp, value)  # a second collector of the same dp would duplicate rows
    return [chosen[dp] for dp in sorted(chosen)]


def dispatch_lazy_compute_data_proto(mesh_name: str, worker_group, *args, **kwargs):
    """Mesh dispatch: query (once, cached) each rank's dp rank for ``mesh_name``, then split."""
    mapping = _mesh_info(worker_group, "_dispatch_info", "_query_dispatch_info", mesh_name)
    dp_size = max(mapping) + 1
    return dispatch_nd_compute(mapping, dp_size, worker_group, *args, **kwargs)


def collect_lazy_compute_data_proto(mesh_name: str, worker_group, *args, **kwargs):
    """Mesh collect: concatenate the collect-mask ranks' outputs in dp order."""
    mask = _mesh_info(worker_group, "_collect_info", "_query_collect_info", mesh_name)
    mapping = getattr(worker_group, "_dispatch_info", {}).get(mesh_name)
    output = collect_nd_compute(mask, mapping, worker_group, *args, **kwargs)
    for value in output:
        if not (_is_data(value) or _looks_like_ref(value)):
            raise InvalidArgumentAssertion(f"expected DataProto or TensorDict outputs from the collecting "
                                           f"ranks, got {type(value).__name__}")
    return _concat(output)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict[str, Callable]:
    """The ``dispatch_mode`` dict for mesh ``mesh_name`` (verl's helper of the same name)."""
    return {
        "dispatch_fn": functools.partial(dispatch_lazy_compute_data_proto, mesh_name),
        "collect_fn": functools.partial(collect_lazy_compute_data_proto, mesh_name),
    }


# ---------------------------------------------------------------------------------------
# registry


DISPATCH_MODE_FN_REGISTRY: dict[Any, dict[str, Callable]] = {
    Dispatch.ONE_TO_ALL: {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all},
    Dispatch.ALL_TO_ALL: {"dispatch_fn": dispatch_all_to_all, "collect_fn": collect_all_to_all},
    Dispatch.DP_COMPUTE: {"dispatch_fn": dispatch_dp_compute, "collect_fn": collect_dp_compute},
    Dispatch.DP_COMPUTE_PROTO: {"dispatch_fn": dispatch_dp_compute_data_proto,
                                "collect_fn": collect_dp_compute_data_proto},
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: {"dispatch_fn": dispatch_dp_compute_data_proto_with_func,
                                          "collect_fn": collect_dp_compute_data_proto},
    Dispatch.DP_COMPUTE_METRIC: {"dispatch_fn": dispatch_dp_compute_data_proto,
                                 "collect_fn": collect_all_to_all},
    Dispatch.DIRECT_ROLLOUT_METHOD: {"dispatch_fn": dispatch_direct_rollout_fn,
                                     "collect_fn": collect_direct_rollout_fn},
}


def get_predefined_dispatch_fn(dispatch_mode) -> dict[str, Callable]:
    """The ``{"dispatch_fn", "collect_fn"}`` pair registered for ``dispatch_mode``."""
    if dispatch_mode is getattr(Dispatch, "RANK_ZERO", None) and dispatch_mode not in DISPATCH_MODE_FN_REGISTRY:
        raise RankZeroDispatchError(
            "Dispatch.RANK_ZERO has no dispatch function (verl does not implement it either); "
            "to run a method on rank 0 only use @register(execute_mode=Execute.RANK_ZERO)")
    return DISPATCH_MODE_FN_REGISTRY[dispatch_mode]


def register_dispatch_mode(dispatch_mode_name: str, dispatch_fn: Callable, collect_fn: Callable) -> None:
    """Add a new ``Dispatch`` member named ``dispatch_mode_name`` with its two functions.

    As in verl the member is registered per process (and pickles by name): register the
    same mode in every process that unpickles it (workers import the defining module).
    """
    dispatch_mode = Dispatch.register(dispatch_mode_name)
    _check_dispatch_mode(dispatch_mode)
    if dispatch_mode in DISPATCH_MODE_FN_REGISTRY:
        raise InvalidArgumentAssertion(f"dispatch_mode_name {dispatch_mode_name} already exists "
                                       f"(update_dispatch_mode replaces its functions)")
    DISPATCH_MODE_FN_REGISTRY[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def update_dispatch_mode(dispatch_mode, dispatch_fn: Callable, collect_fn: Callable) -> None:
    """Replace the functions of an existing dispatch mode."""
    if not isinstance(dispatch_mode, Dispatch) or dispatch_mode not in DISPATCH_MODE_FN_REGISTRY:
        raise InvalidArgumentAssertion(f"dispatch_mode {dispatch_mode!r} not found: register it first "
                                       f"(register_dispatch_mode)")
    DISPATCH_MODE_FN_REGISTRY[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def get_predefined_execute_fn(execute_mode) -> dict[str, str]:
    """The WorkerGroup method that executes ``execute_mode`` (``execute_all`` / ``execute_rank_zero``)."""
    table = {Execute.ALL: {"execute_fn_name": "execute_all"},
             Execute.RANK_ZERO: {"execute_fn_name": "execute_rank_zero"}}
    return table[execute_mode]


def _check_dispatch_mode(dispatch_mode) -> None:
    if not (isinstance(dispatch_mode, Dispatch) or (
            isinstance(dispatch_mode, dict) and "dispatch_fn" in dispatch_mode and "collect_fn" in dispatch_mode)):
        raise InvalidArgumentAssertion(f"dispatch_mode {dispatch_mode!r} is not supported: a Dispatch member "
                                       f"or a dict with 'dispatch_fn' and 'collect_fn'")


def _check_execute_mode(execute_mode) -> None:
    if not isinstance(execute_mode, Execute):
        raise InvalidArgumentAssertion(f"execute_mode {execute_mode!r} is not supported: Execute.ALL or "
                                       f"Execute.RANK_ZERO")


def _verl_mesh_name(dispatch_fn: Any) -> str | None:
    """The mesh of verl's own ``make_nd_compute_dataproto_dispatch_fn(mesh)`` dispatch
    function (its functions assert a verl WorkerGroup; this module's do the same job on
    Podium's), else None."""
    func = getattr(dispatch_fn, "func", None)
    if (isinstance(dispatch_fn, functools.partial) and len(dispatch_fn.args) == 1
            and getattr(func, "__name__", "") == "dispatch_lazy_compute_data_proto"
            and getattr(func, "__module__", "").startswith("verl.")):
        return dispatch_fn.args[0]
    return None


def resolve_dispatch_mode(dispatch_mode) -> tuple[Callable, Callable]:
    """``(dispatch_fn, collect_fn)`` for a Dispatch member or a custom dict."""
    if isinstance(dispatch_mode, dict):
        _check_dispatch_mode(dispatch_mode)
        mesh = _verl_mesh_name(dispatch_mode["dispatch_fn"])
        if mesh is not None:
            dispatch_mode = make_nd_compute_dataproto_dispatch_fn(mesh)
        return dispatch_mode["dispatch_fn"], dispatch_mode["collect_fn"]
    fns = get_predefined_dispatch_fn(dispatch_mode)
    return fns["dispatch_fn"], fns["collect_fn"]


# ---------------------------------------------------------------------------------------
# execute-side helpers


def slice_for_ranks(n: int, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    """verl's ``execute_all_async`` slicing rule: the (args, kwargs) each of ``n`` ranks gets.

    If every positional argument and every keyword value is a ``list`` (tuples do not count)
    of length ``n``, rank i gets the i-th element of each; otherwise every rank gets the
    arguments as they are. No arguments at all counts as sliced (every rank gets none).
    """
    values = list(args) + list(kwargs.values())
    if all(isinstance(v, list) and len(v) == n for v in values):
        return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}) for i in range(n)]
    return [(tuple(args), dict(kwargs)) for _ in range(n)]


def unpad_output(output: Any, padding_size: int, padded_rows: int | None, world_size: int) -> Any:
    """Remove auto-padding from a collected output.

    A DataProto/TensorDict keeps its first ``len - pad`` rows; a DataProtoFuture gets the
    matching row range. A per-rank list (``world_size`` entries, e.g. DP_COMPUTE_METRIC)
    keeps the outputs of ranks whose chunk held at least one real row; another list drops
    its last ``pad`` entries (verl's rule); anything else is returned as is.
    """
    if not padding_size:
        return output
    if _is_proto(output) or isinstance(output, TensorDict):
        return output[:len(output) - padding_size]
    if isinstance(output, DataProtoFuture):
        from podium.controller.session.futures import unpadded_future
        return unpadded_future(output, padding_size)
    if isinstance(output, list):
        if padded_rows is not None and len(output) == world_size:
            real = padded_rows - padding_size
            per_rank = padded_rows // world_size
            return output[:math.ceil(real / per_rank)] if per_rank else output
        return output[:-padding_size]
    return output


def unique_payload_groups(per_rank: list[tuple[tuple, dict]]) -> list[list[int]]:
    """Group ranks whose arguments are the very same objects, so their payload is encoded once."""
    if per_rank:  # ONE_TO_ALL: every rank holds the very same tuple and dict
        args0, kwargs0 = per_rank[0]
        if all(args is args0 and kwargs is kwargs0 for args, kwargs in per_rank):
            return [list(range(len(per_rank)))]
    groups: dict[tuple, list[int]] = {}
    for rank, (args, kwargs) in enumerate(per_rank):
        key = tuple(id(a) for a in args) + tuple((k, id(v)) for k, v in sorted(kwargs.items()))
        groups.setdefault(key, []).append(rank)
    return list(groups.values())

