"""Dispatch/collect functions, the slicing rule, auto-padding and mesh dispatch (no sockets)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from podium.controller.dispatch import modes as d
from podium.dataproto import DataProto
from podium.worker.decorator import Dispatch, Execute


def wg(ws: int, **attrs):
    return types.SimpleNamespace(world_size=ws, **attrs)


def proto(n: int, *, padding: bool = False) -> DataProto:
    return DataProto.from_dict(tensors={"a": torch.zeros(n, dtype=torch.long)},
                               non_tensors={"s": np.array([str(i) for i in range(n)], dtype=object)},
                               auto_padding=padding)


def run(group, dispatch_mode, method, *args, **kwargs):
    """What WorkerGroup does in-process: dispatch -> pop pad -> execute_all -> collect -> unpad."""
    dispatch_fn, collect_fn = d.resolve_dispatch_mode(dispatch_mode)
    args, kwargs = dispatch_fn(group, *args, **kwargs)
    pad = kwargs.pop(d.PADDING_SIZE_KEY, 0)
    padded_rows = kwargs.pop(d.PADDED_ROWS_KEY, None)
    per_rank = d.slice_for_ranks(group.world_size, args, kwargs)
    outputs = [method(rank, *a, **kw) for rank, (a, kw) in enumerate(per_rank)]
    return d.unpad_output(collect_fn(group, outputs), pad, padded_rows, group.world_size)


def add_rank(rank, data):
    out = DataProto.from_dict(tensors={"a": data.batch["a"] + rank},
                              non_tensors=dict(data.non_tensor_batch), meta_info=dict(data.meta_info))
    return out


# ---- registry ------------------------------------------------------------------------


def test_registry_has_every_predefined_mode_but_rank_zero():
    names = {m.name for m in d.DISPATCH_MODE_FN_REGISTRY}
    assert names >= {"ONE_TO_ALL", "ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_PROTO",
                     "DP_COMPUTE_PROTO_WITH_FUNC", "DP_COMPUTE_METRIC", "DIRECT_ROLLOUT_METHOD"}
    assert "RANK_ZERO" not in names


def test_rank_zero_dispatch_is_refused_with_a_clear_error():
    with pytest.raises(KeyError) as info:
        d.get_predefined_dispatch_fn(Dispatch.RANK_ZERO)
    assert isinstance(info.value, ValueError)
    assert "Execute.RANK_ZERO" in str(info.value)


def test_direct_rollout_is_forbidden():
    with pytest.raises(NotImplementedError, match="Direct rollout call is forbidden"):
        run(wg(2), Dispatch.DIRECT_ROLLOUT_METHOD, lambda r: r)


def test_execute_fns():
    assert d.get_predefined_execute_fn(Execute.ALL) == {"execute_fn_name": "execute_all"}
    assert d.get_predefined_execute_fn(Execute.RANK_ZERO) == {"execute_fn_name": "execute_rank_zero"}


def test_register_and_update_dispatch_mode():
    def dispatch_twice(group, *args, **kwargs):
        return tuple([a * 2] * group.world_size for a in args), {}

    def collect_sum(group, outputs):
        return sum(outputs)

    d.register_dispatch_mode("test_mode_podium", dispatch_twice, collect_sum)
    try:
        mode = Dispatch.TEST_MODE_PODIUM
        assert d.get_predefined_dispatch_fn(mode)["collect_fn"] is collect_sum
        assert run(wg(3), mode, lambda r, x: x + r, 5) == 10 * 3 + 3
        with pytest.raises(ValueError):
            d.register_dispatch_mode("test_mode_podium", dispatch_twice, collect_sum)
        d.update_dispatch_mode(mode, dispatch_twice, lambda group, outputs: max(outputs))
        assert run(wg(3), mode, lambda r, x: x + r, 5) == 12
    finally:
        d.DISPATCH_MODE_FN_REGISTRY.pop(Dispatch.TEST_MODE_PODIUM, None)
        Dispatch.remove("test_mode_podium")
    with pytest.raises(AssertionError):
        d.update_dispatch_mode({"dispatch_fn": dispatch_twice, "collect_fn": collect_sum},
                               dispatch_twice, collect_sum)


def test_custom_dict_mode():
    mode = {"dispatch_fn": lambda g, x: (([x, x + 2] * (g.world_size // 2),), {}),
            "collect_fn": lambda g, outs: outs}
    assert run(wg(4), mode, lambda r, x: x, 8) == [8, 10, 8, 10]


# ---- simple modes and the slicing rule --------------------------------------------------


@pytest.mark.parametrize("args,kwargs,sliced", [
    (([1, 2, 3, 4],), {}, True),                      # list of len ws: scattered
    (((1, 2, 3, 4),), {}, False),                     # tuples never count
    (([1, 2, 3, 4], 7), {}, False),                   # a list plus a scalar: not sliced
    (([1, 2, 3],), {}, False),                        # wrong length
    (([1, 2, 3, 4],), {"k": [5, 6, 7, 8]}, True),     # every value a list of len ws
    (([1, 2, 3, 4],), {"k": 5}, False),
    ((), {}, True),                                   # vacuously sliced
])
def test_slicing_rule(args, kwargs, sliced):
    per_rank = d.slice_for_ranks(4, args, kwargs)
    assert len(per_rank) == 4
    if sliced:
        for i, (a, kw) in enumerate(per_rank):
            assert a == tuple(x[i] for x in args)
            assert kw == {k: v[i] for k, v in kwargs.items()}
    else:
        assert all(a == tuple(args) and kw == kwargs for a, kw in per_rank)


def test_one_to_all_and_all_to_all():
    assert run(wg(3), Dispatch.ONE_TO_ALL, lambda r, x, y=0: (r, x, y), 7, y=1) == [(0, 7, 1), (1, 7, 1), (2, 7, 1)]
    assert run(wg(2), Dispatch.ALL_TO_ALL, lambda r, x: (r, x), [5, 6]) == [(0, 5), (1, 6)]
    assert run(wg(2), Dispatch.ALL_TO_ALL, lambda r, x: (r, x), 5) == [(0, 5), (1, 5)]


@pytest.mark.parametrize("value", [[1, 2, 3], (1, 2, 3)])
def test_dp_compute_slices_lists_and_tuples(value):
    assert run(wg(3), Dispatch.DP_COMPUTE, lambda r, x: x * 10, value) == [10, 20, 30]


@pytest.mark.parametrize("value", [[1, 2], 5, "abc"])
def test_dp_compute_rejects_bad_lengths(value):
    with pytest.raises(AssertionError, match="DP_COMPUTE"):
        run(wg(3), Dispatch.DP_COMPUTE, lambda r, x: x, value)


def test_dp_compute_proto_chunks_and_concats():
    out = run(wg(4), Dispatch.DP_COMPUTE_PROTO, add_rank, proto(8))
    assert out.batch["a"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(AssertionError):
        run(wg(4), Dispatch.DP_COMPUTE_PROTO, add_rank, 5)


def test_dp_compute_proto_without_padding_needs_equal_chunks():
    with pytest.raises(AssertionError, match="equal chunk"):
        run(wg(4), Dispatch.DP_COMPUTE_PROTO, add_rank, proto(10))


def test_dp_compute_proto_with_func():
    def apply(rank, fn, data):
        return fn(rank, data)

    out = run(wg(2), Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, apply, add_rank, proto(4))
    assert out.batch["a"].tolist() == [0, 0, 1, 1]
    with pytest.raises(AssertionError, match="function"):
        run(wg(2), Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, apply, proto(4))


# ---- auto padding -----------------------------------------------------------------------


@pytest.mark.parametrize("n", range(4, 20))
@pytest.mark.parametrize("as_kwarg", [False, True])
def test_auto_padding_sizes(n, as_kwarg):
    data = proto(n, padding=True)
    before_len, before_s = len(data), data.non_tensor_batch["s"].copy()
    if as_kwarg:
        out = run(wg(4), Dispatch.DP_COMPUTE_PROTO, lambda r, data: add_rank(r, data), data=data)
    else:
        out = run(wg(4), Dispatch.DP_COMPUTE_PROTO, add_rank, data)
    chunk = -(-n // 4)
    assert out.batch["a"].tolist() == [i // chunk for i in range(n)]
    assert out.non_tensor_batch["s"].tolist() == [str(i) for i in range(n)]
    # the caller's batch is never touched (verl pads it in place)
    assert len(data) == before_len
    assert data.non_tensor_batch["s"].tolist() == before_s.tolist()


@pytest.mark.parametrize("n,expected", [(1, [0]), (8, [0, 0, 1, 1, 2, 2, 3, 3]),
                                        (10, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3])])
def test_auto_padding_examples(n, expected):
    out = run(wg(4), Dispatch.DP_COMPUTE_PROTO, add_rank, proto(n, padding=True))
    assert out.batch["a"].tolist() == expected


def test_padding_enabled_args_must_agree_in_length():
    with pytest.raises(AssertionError, match="same length"):
        run(wg(4), Dispatch.DP_COMPUTE_PROTO, lambda r, a, b: a, proto(5, padding=True), proto(6, padding=True))


@pytest.mark.parametrize("n,kept", [(10, 4), (1, 1), (5, 3), (8, 4), (9, 3)])
def test_metric_padding_drops_only_pure_padding_ranks(n, kept):
    # n=10, ws=4: pad 2, chunks of 3 rows; every rank holds real rows -> 4 metrics (verl: 2).
    # n=9: pad 3, chunks of 3 -> ranks 0..2 hold rows 0..8, rank 3 only padding -> 3.
    out = run(wg(4), Dispatch.DP_COMPUTE_METRIC, lambda r, data: {"rank": r, "rows": len(data)},
              proto(n, padding=True))
    assert [m["rank"] for m in out] == list(range(kept))


def test_unpad_other_lists_use_verl_rule():
    assert d.unpad_output([1, 2, 3, 4, 5], 2, None, 4) == [1, 2, 3]
    assert d.unpad_output("x", 2, 8, 4) == "x"


# ---- TensorDict and jagged nested tensors -----------------------------------------------


def jagged_td(n: int) -> TensorDict:
    nested = torch.nested.as_nested_tensor([torch.arange(i + 1) for i in range(n)], layout=torch.jagged)
    return TensorDict({"a": torch.arange(n), "pos": nested}, batch_size=[n])


def test_tensordict_split_and_concat_keep_jagged_rows():
    parts = d.split_tensordict(jagged_td(4), 2)
    assert [p["a"].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert [t.tolist() for t in parts[1]["pos"].unbind()] == [[0, 1, 2], [0, 1, 2, 3]]
    back = d.concat_tensordict(parts)
    assert [t.tolist() for t in back["pos"].unbind()] == [list(range(i + 1)) for i in range(4)]
    with pytest.raises(AssertionError):
        d.split_tensordict(jagged_td(3), 2)


def test_dp_compute_proto_accepts_tensordicts():
    def plus(rank, td):
        return TensorDict({"a": td["a"] + 10 + rank}, batch_size=td.batch_size)

    out = run(wg(2), Dispatch.DP_COMPUTE_PROTO, plus, TensorDict({"a": torch.arange(4)}, batch_size=[4]))
    assert out["a"].tolist() == [10, 11, 13, 14]


# ---- nd mesh dispatch -------------------------------------------------------------------


class MeshGroup:
    """A stand-in WorkerGroup whose ranks answer the mesh queries from a table."""

    def __init__(self, mapping, mask):
        self.world_size = len(mapping)
        self._mapping, self._mask = mapping, mask
        self.queries = []

    def _query_dispatch_info(self, mesh):
        self.queries.append(("dispatch", mesh))
        return list(self._mapping)

    def _query_collect_info(self, mesh):
        self.queries.append(("collect", mesh))
        return list(self._mask)


def test_nd_dispatch_dp2_tp2_mapping_collect_and_cache():
    group = MeshGroup([0, 0, 1, 1], [True, False, True, False])
    mode = d.make_nd_compute_dataproto_dispatch_fn("actor")
    data = proto(4)
    args, kwargs = mode["dispatch_fn"](group, data)
    shards = args[0]
    assert [len(s) for s in shards] == [2, 2, 2, 2]
    assert shards[0] is shards[1] and shards[2] is shards[3] and shards[0] is not shards[2]
    # one payload per dp replica: ranks 0,1 share, ranks 2,3 share
    groups = d.unique_payload_groups(d.slice_for_ranks(4, args, kwargs))
    assert sorted(groups) == [[0, 1], [2, 3]]
    out = run(group, mode, lambda r, x: add_rank(r, x), data)
    assert out.batch["a"].tolist() == [0, 0, 2, 2]
    run(group, mode, lambda r, x: x, data)
    assert group.queries == [("dispatch", "actor"), ("collect", "actor")]  # cached per mesh


def test_nd_collect_follows_dp_order_not_rank_order():
    # verl returns [3, 1] here (reversed against the input [1, 2])
    group = MeshGroup([1, 1, 0, 0], [True, False, True, False])
    mode = d.make_nd_compute_dataproto_dispatch_fn("m")
    data = DataProto.from_dict(tensors={"a": torch.tensor([1, 2])})

    def method(rank, x):
        tp = rank % 2
        dp = group._mapping[rank]
        return DataProto.from_dict(tensors={"a": x.batch["a"] + (tp + 1) * dp})

    assert run(group, mode, method, data).batch["a"].tolist() == [1, 3]


def test_nd_dispatch_keyword_only_and_replicated_scalars():
    group = MeshGroup([0, 1], [True, True])
    mode = d.make_nd_compute_dataproto_dispatch_fn("k")
    out = run(group, mode, lambda r, data, scale: DataProto.from_dict(
        tensors={"a": data.batch["a"] * scale}), data=DataProto.from_dict(tensors={"a": torch.tensor([1, 2])}), scale=3)
    assert out.batch["a"].tolist() == [3, 6]


def test_nd_dispatch_rejects_indivisible_and_checks_query_length():
    with pytest.raises(AssertionError):
        run(MeshGroup([0, 1], [True, True]), d.make_nd_compute_dataproto_dispatch_fn("x"),
            lambda r, x: x, proto(3))
    bad = MeshGroup([0, 1], [True, True])
    bad.world_size = 3
    with pytest.raises(AssertionError, match="world_size"):
        run(bad, d.make_nd_compute_dataproto_dispatch_fn("y"), lambda r, x: x, proto(2))


def test_nd_dispatch_tensordict_jagged():
    group = MeshGroup([0, 0, 1, 1], [True, False, True, False])
    mode = d.make_nd_compute_dataproto_dispatch_fn("td")
    out = run(group, mode, lambda r, td: td, jagged_td(4))
    assert out["a"].tolist() == [0, 1, 2, 3]
    assert [t.tolist() for t in out["pos"].unbind()] == [list(range(i + 1)) for i in range(4)]


def test_ranks_sharing_one_entry_make_one_payload_group_and_equal_copies_do_not():
    entry = ((proto(2),), {"k": 1})
    assert d.unique_payload_groups([entry] * 5) == [[0, 1, 2, 3, 4]]
    value = proto(2)
    # Separate tuples over the same objects still share (by identity of the values).
    assert d.unique_payload_groups([((value,), {}), ((value,), {})]) == [[0, 1]]
    # Equal but distinct values are encoded apart.
    assert d.unique_payload_groups([((proto(2),), {}), ((proto(2),), {})]) == [[0], [1]]
