"""podium.dataproto.DataProto: verl's semantics (verl.protocol's names and behaviour, auto-padding)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from podium import codec
from podium.errors import InvalidArgumentAssertion, InvalidArgumentError, PodiumError
from podium.dataproto import (
    PADDING_SIZE_KEY,
    DataProto,
    DataProtoConfig,
    DataProtoItem,
    pad_dataproto_to_divisor,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)


@pytest.fixture(autouse=True)
def no_global_padding(monkeypatch):
    """Every test starts with auto-padding off and leaves it so."""
    monkeypatch.delenv("VERL_AUTO_PADDING", raising=False)
    DataProtoConfig.auto_padding = False
    yield
    DataProtoConfig.auto_padding = False


def rows(n: int, **kw) -> DataProto:
    """n rows: a = 0..n-1, b = 2a (2-D), s = '0'..'n-1'."""
    a = torch.arange(n)
    return DataProto.from_dict(tensors={"a": a, "b": torch.stack([a, a], dim=1) * 2},
                               non_tensors={"s": [str(i) for i in range(n)]}, **kw)


def a_of(d: DataProto) -> list[int]:
    return d.batch["a"].tolist()


# --------------------------------------------------------------------------- basics


def test_from_dict_len_and_consistency():
    d = rows(5, meta_info={"k": 1})
    assert len(d) == 5 and d.meta_info == {"k": 1}
    assert d.non_tensor_batch["s"].dtype == object
    assert len(DataProto()) == 0
    assert len(DataProto(non_tensor_batch={"x": np.arange(3)})) == 3


def test_from_dict_rejects_mismatched_batch_sizes():
    with pytest.raises(AssertionError, match="same batch size"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)})


def test_consistency_rejects_short_non_tensor():
    with pytest.raises(AssertionError, match="not equal to batch size"):
        DataProto(batch=TensorDict({"a": torch.zeros(3)}, batch_size=[3]),
                  non_tensor_batch={"s": np.array([1, 2], dtype=object)})


def test_from_single_dict_splits_by_type():
    d = DataProto.from_single_dict({"a": torch.zeros(2), "s": np.array(["x", "y"], dtype=object)},
                                   auto_padding=True)
    assert list(d.batch.keys()) == ["a"] and list(d.non_tensor_batch) == ["s"]
    assert d.is_padding_enabled()
    with pytest.raises(ValueError, match="Unsupported type"):
        DataProto.from_single_dict({"a": [1, 2]})


INDEXING = {
    "slice": (slice(1, 4), [1, 2, 3]),
    "step-slice": (slice(None, None, 2), [0, 2, 4]),
    "list": ([4, 0], [4, 0]),
    "ndarray": (np.array([2, 3]), [2, 3]),
    "tensor": (torch.tensor([1]), [1]),
    "bool-mask": (torch.tensor([True, False, False, False, True]), [0, 4]),
    "bool-list": ([False, True, False, True, False], [1, 3]),
}


@pytest.mark.parametrize("name", INDEXING)
def test_getitem_returns_dataproto(name):
    item, want = INDEXING[name]
    d = rows(5, meta_info={"m": 1})
    got = d[item]
    assert type(got) is DataProto and a_of(got) == want
    assert list(got.non_tensor_batch["s"]) == [str(i) for i in want]
    assert got.meta_info is d.meta_info


def test_getitem_int_returns_item_and_bad_index_raises():
    item = rows(5)[np.int64(3)]
    assert isinstance(item, DataProtoItem)
    assert item.batch["a"].item() == 3 and item.non_tensor_batch["s"] == "3"
    with pytest.raises(TypeError):
        rows(5)["a"]


def test_select_pop_rename():
    d = rows(3, meta_info={"x": 1, "y": 2})
    sel = d.select(batch_keys=["a"], meta_info_keys=["x"])
    assert list(sel.batch.keys()) == ["a"] and sel.meta_info == {"x": 1}
    popped = d.pop(batch_keys=["b"], non_tensor_batch_keys=["s"], meta_info_keys=["y"])
    assert list(d.batch.keys()) == ["a"] and d.non_tensor_batch == {} and d.meta_info == {"x": 1}
    assert popped.batch["b"].shape == (3, 2) and popped.meta_info == {"y": 2}
    d.rename("a", "c")
    assert list(d.batch.keys()) == ["c"]
    with pytest.raises(ValueError):
        d.rename(["c"], ["d", "e"])


def test_union_merges_and_rejects_conflicts():
    left = rows(3, meta_info={"k": 1})
    right = DataProto.from_dict({"c": torch.ones(3)}, {"s": [str(i) for i in range(3)]}, {"j": 2})
    out = left.union(right)
    assert out is left and set(out.batch.keys()) == {"a", "b", "c"} and out.meta_info == {"k": 1, "j": 2}
    with pytest.raises(AssertionError):
        union_tensor_dict(rows(3).batch, DataProto.from_dict({"a": torch.ones(3)}).batch)
    nan = np.array([np.nan, 1.0])
    assert union_numpy_dict({"x": nan}, {"x": nan.copy()})["x"] is not None
    with pytest.raises(AssertionError):
        union_numpy_dict({"x": np.array(["a"], dtype=object)}, {"x": np.array(["b"], dtype=object)})


def test_reorder_repeat_sample_level_repeat():
    d = rows(3)
    d.reorder(torch.tensor([2, 0, 1]))
    assert a_of(d) == [2, 0, 1] and list(d.non_tensor_batch["s"]) == ["2", "0", "1"]
    d = rows(2)
    assert a_of(d.repeat(2, interleave=True)) == [0, 0, 1, 1]
    tiled = d.repeat(3, interleave=False)
    assert a_of(tiled) == [0, 1, 0, 1, 0, 1] and list(tiled.non_tensor_batch["s"]) == ["0", "1"] * 3
    assert tiled.batch["b"].shape == (6, 2)
    assert a_of(d.sample_level_repeat([0, 3])) == [1, 1, 1]


def test_to_moves_batch_in_place():
    d = rows(2)
    assert d.to("cpu") is d and d.batch.device == torch.device("cpu")


def test_make_iterator_yields_minibatches_with_meta_info():
    d = rows(6, meta_info={"e": 1})
    batches = list(d.make_iterator(mini_batch_size=2, epochs=2))
    assert [a_of(b) for b in batches] == [[0, 1], [2, 3], [4, 5]] * 2
    assert all(b.meta_info == {"e": 1} for b in batches)
    shuffled = list(d.make_iterator(mini_batch_size=3, epochs=1, seed=1, dataloader_kwargs={"shuffle": True}))
    assert sorted(sum((a_of(b) for b in shuffled), [])) == list(range(6))


# --------------------------------------------------------------------------- split / concat


def test_chunk_equal_and_unequal():
    chunks = rows(8, meta_info={"m": 1}).chunk(4)
    assert [a_of(c) for c in chunks] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(c.non_tensor_batch["s"]) for c in chunks][1] == ["2", "3"]
    assert all(c.meta_info == {"m": 1} for c in chunks)
    with pytest.raises(AssertionError, match="only support equal chunk. Got size of DataProto 10 and chunk 4."):
        rows(10).chunk(4)
    # With padding enabled uneven chunks follow torch.chunk, as in verl.
    assert [len(c) for c in rows(10, auto_padding=True).chunk(4)] == [3, 3, 3, 1]
    with pytest.raises(AssertionError, match="pad to a multiple"):
        rows(6, auto_padding=True).chunk(4)


def test_chunk_without_batch_splits_non_tensors():
    d = DataProto(non_tensor_batch={"s": np.arange(6)})
    assert [c.non_tensor_batch["s"].tolist() for c in d.chunk(3)] == [[0, 1], [2, 3], [4, 5]]


def test_split():
    assert [a_of(p) for p in rows(5).split(2)] == [[0, 1], [2, 3], [4]]


def test_concat_merges_metrics_and_keeps_other_meta():
    parts = [
        DataProto.from_dict({"a": torch.tensor([0])}, meta_info={"t": 1, "metrics": {"loss": 0.5}}),
        DataProto.from_dict({"a": torch.tensor([1])}, meta_info={"t": 1, "metrics": [{"loss": 0.4}, {"loss": 0.3}]}),
        DataProto.from_dict({"a": torch.tensor([2])}, meta_info={"t": 1}),
    ]
    out = DataProto.concat(parts)
    assert a_of(out) == [0, 1, 2]
    assert out.meta_info == {"t": 1, "metrics": {"loss": [0.5, 0.4, 0.3]}}


def test_concat_conflicting_meta_info_raises():
    parts = [DataProto.from_dict({"a": torch.tensor([0])}, meta_info={"k": 1}),
             DataProto.from_dict({"a": torch.tensor([1])}, meta_info={"k": 2})]
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'k'"):
        DataProto.concat(parts)
    with pytest.raises(ValueError):
        DataProto.concat([])


def test_concat_keeps_subclass_and_non_tensors():
    class MyProto(DataProto):
        pass

    parts = [MyProto.from_dict({"a": torch.tensor([i])}, {"s": [str(i)]}) for i in range(3)]
    out = DataProto.concat(parts)
    assert type(out) is MyProto and list(out.non_tensor_batch["s"]) == ["0", "1", "2"]


# --------------------------------------------------------------------------- padding


def test_padding_in_place_repeats_last_row():
    d = rows(10)
    d.padding(2)
    assert len(d) == 12 and list(d.non_tensor_batch["s"])[-4:] == ["8", "9", "9", "9"]
    assert a_of(d)[-3:] == [9, 9, 9]
    first = rows(3)
    first.padding(2, padding_candidate="first")
    assert a_of(first) == [0, 1, 2, 0, 0]


def test_padded_returns_new_object_and_leaves_caller_alone():
    d = rows(10, meta_info={"k": 1, "metrics": {"x": 1}})
    out = d.padded(2)
    assert len(d) == 10 and len(out) == 12 and a_of(out)[-3:] == [9, 9, 9]
    assert out.meta_info == d.meta_info and out.meta_info is not d.meta_info
    same = d.padded(0)
    assert same is not d and len(same) == 10
    with pytest.raises(ValueError):
        DataProto.from_dict({"a": torch.zeros(0)}).padded(1)


PADDING_SWITCHES = {
    "off": ({}, None, False, False),
    "meta_info": ({"auto_padding": True}, None, False, True),
    "class-flag": ({}, None, True, True),
    "env-1": ({}, "1", False, True),
    "env-true": ({}, "true", False, True),
    "env-TRUE": ({}, "TRUE", False, True),
    "env-0": ({}, "0", False, False),
    "env-yes": ({}, "yes", False, False),
}


@pytest.mark.parametrize("name", PADDING_SWITCHES)
def test_is_padding_enabled(name, monkeypatch):
    kwargs, env, flag, want = PADDING_SWITCHES[name]
    if env is not None:
        monkeypatch.setenv("VERL_AUTO_PADDING", env)
    DataProtoConfig.auto_padding = flag
    assert rows(2, **kwargs).is_padding_enabled() is want


def test_padding_key_name_matches_verl():
    assert PADDING_SIZE_KEY == "_padding_size_key_x123d"
    assert DataProtoConfig.auto_padding_key == "_verl_auto_padding"


@pytest.mark.parametrize("length,want", [(10, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]), (1, [0]),
                                         (8, [0, 0, 1, 1, 2, 2, 3, 3])])
def test_dispatcher_style_pad_chunk_concat_unpad(length, want):
    """verl's auto-padding example: 4 ranks, a = zeros, each rank adds its rank."""
    world = 4
    data = DataProto.from_dict({"a": torch.zeros(length, dtype=torch.int64)},
                               {"s": [str(i) for i in range(length)]}, auto_padding=True)
    pad = (world - length % world) % world
    shards = data.padded(pad).chunk(world)
    outs = []
    for rank, shard in enumerate(shards):
        shard = codec.loads(codec.dumps(shard))  # as a worker would receive it
        shard.batch["a"] += rank
        outs.append(shard)
    result = unpad_dataproto(DataProto.concat(outs), pad)
    assert a_of(result) == want
    assert list(result.non_tensor_batch["s"]) == [str(i) for i in range(length)]
    assert len(data) == length  # the caller's batch was not padded


def test_pad_dataproto_to_divisor_cycles_from_start():
    d = rows(3, meta_info={"metrics": {"m": 1}})
    padded, pad = pad_dataproto_to_divisor(d, 7)
    assert pad == 4 and a_of(padded) == [0, 1, 2, 0, 1, 2, 0]
    assert list(padded.non_tensor_batch["s"]) == ["0", "1", "2", "0", "1", "2", "0"]
    assert padded.meta_info == {"metrics": {"m": 1}}  # not merged with itself
    assert a_of(unpad_dataproto(padded, pad)) == [0, 1, 2]
    same, zero = pad_dataproto_to_divisor(rows(4), 2)
    assert zero == 0 and len(same) == 4
    assert unpad_dataproto(same, 0) is same
    ten, pad = pad_dataproto_to_divisor(rows(10), 4)
    assert pad == 2 and a_of(ten)[-2:] == [0, 1]


# --------------------------------------------------------------------------- errors

# Each of verl's asserts, as a call that fails it, and the numbers its message must carry.
ASSERTS = {
    "chunk-uneven": (lambda: rows(10).chunk(4), ["10", "4"]),
    "chunk-torch-fewer": (lambda: rows(6, auto_padding=True).chunk(4), ["6", "4", "3"]),
    "batch-sizes": (lambda: DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)}), ["3", "4"]),
    "num-batch-dims": (lambda: DataProto.from_dict({"a": torch.zeros(3)}, num_batch_dims=0), ["0"]),
    "short-column": (lambda: DataProto(batch=rows(3).batch, non_tensor_batch={"s": np.arange(2)}), ["2", "3"]),
    "two-batch-dims": (lambda: DataProto(batch=TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3])),
                       ["2, 3"]),
    "mini-batch": (lambda: rows(5).make_iterator(mini_batch_size=2, epochs=1), ["5", "2"]),
    "conflicting-meta": (lambda: DataProto.concat([rows(1, meta_info={"k": 1}), rows(1, meta_info={"k": 2})]),
                         ["'k'"]),
    "union-sizes": (lambda: union_tensor_dict(rows(3).batch, rows(2).batch), ["(3,)", "(2,)"]),
    "pop-missing": (lambda: rows(2).pop(batch_keys=["nope"]), ["nope"]),
    "repeat-2d": (lambda: rows(2).sample_level_repeat(np.ones((2, 2), dtype=int)), ["(2, 2)"]),
    "not-a-dataproto": (lambda: pad_dataproto_to_divisor([1, 2], 2), ["list"]),
}


@pytest.mark.parametrize("name", ASSERTS)
def test_a_failed_verl_assert_is_a_podium_error_verl_code_still_catches(name):
    call, numbers = ASSERTS[name]
    with pytest.raises(AssertionError) as caught:  # verl's code catches AssertionError
        call()
    assert isinstance(caught.value, InvalidArgumentAssertion) and isinstance(caught.value, InvalidArgumentError)
    assert all(n in str(caught.value) for n in numbers), str(caught.value)


@pytest.mark.parametrize("call", [lambda: DataProto.concat([]), lambda: rows(3).chunk(0),
                                  lambda: rows(3).rename(["a"], ["x", "y"]),
                                  lambda: DataProto.from_single_dict({"x": [1]}),
                                  lambda: DataProto.from_dict({"a": torch.zeros(0)}).padded(1),
                                  lambda: pad_dataproto_to_divisor(rows(3), 0),
                                  lambda: rows(4).make_iterator(mini_batch_size=0, epochs=1)],
                         ids=["concat-empty", "chunk-zero", "rename-lengths", "single-dict-type", "pad-empty",
                              "divisor-zero", "mini-batch-zero"])
def test_a_bad_argument_is_an_invalid_argument_error_and_a_value_error(call):
    with pytest.raises(ValueError) as caught:
        call()
    assert isinstance(caught.value, InvalidArgumentError)


def test_a_bad_index_type_is_a_podium_error_and_a_type_error():
    with pytest.raises(TypeError) as caught:
        rows(3)[{"a": 1}]
    assert isinstance(caught.value, PodiumError)


def test_a_failed_pop_takes_nothing():
    d = rows(3, meta_info={"m": 1})
    with pytest.raises(InvalidArgumentAssertion, match="missing"):
        d.pop(batch_keys=["a"], non_tensor_batch_keys=["s"], meta_info_keys=["missing"])
    assert set(d.batch.keys()) == {"a", "b"} and set(d.non_tensor_batch) == {"s"} and d.meta_info == {"m": 1}


# --------------------------------------------------------------------------- pickling


def nested_batch() -> DataProto:
    batch = TensorDict({"a": torch.arange(4), "sub": TensorDict({"x": torch.ones(4, 2)}, batch_size=[4])},
                       batch_size=[4])
    return DataProto(batch=batch, non_tensor_batch={"s": np.array(list("wxyz"), dtype=object)},
                     meta_info={"k": [1, 2]})


@pytest.mark.parametrize("round_trip", [lambda v: pickle.loads(pickle.dumps(v)),
                                        lambda v: codec.decode(bytearray(codec.dumps(v)))],
                         ids=["pickle", "codec"])
def test_pickles_with_nested_tensordict(round_trip):
    d = nested_batch()
    got = round_trip(d)
    assert type(got) is DataProto and len(got) == 4
    assert torch.equal(got.batch["a"], d.batch["a"]) and torch.equal(got.batch["sub", "x"], d.batch["sub", "x"])
    assert list(got.non_tensor_batch["s"]) == list("wxyz") and got.meta_info == {"k": [1, 2]}
    empty = round_trip(DataProto(non_tensor_batch={"s": np.arange(3)}))
    assert empty.batch is None and len(empty) == 3


def test_state_holds_plain_tensors_not_saved_bytes():
    state = nested_batch().__getstate__()
    entries, batch_size = state["batch"]
    assert batch_size == (4,) and isinstance(entries["a"], torch.Tensor)
    assert not any(isinstance(v, (bytes, bytearray)) for v in entries.values())


NESTED_OPS = {
    "select_idxs": (lambda d: d[[0, 2]], [0, 2]),
    "repeat": (lambda d: d.repeat(2), [0, 0, 1, 1, 2, 2, 3, 3]),
    "repeat-tiled": (lambda d: d.repeat(2, interleave=False), [0, 1, 2, 3, 0, 1, 2, 3]),
    "padded": (lambda d: d.padded(2), [0, 1, 2, 3, 3, 3]),
    "concat": (lambda d: DataProto.concat([d, d[:1]]), [0, 1, 2, 3, 0]),
    "chunk": (lambda d: d.chunk(2)[1], [2, 3]),
    "sample_level_repeat": (lambda d: d.sample_level_repeat([1, 0, 2, 0]), [0, 2, 2]),
    "pad_to_divisor": (lambda d: pad_dataproto_to_divisor(d, 3)[0], [0, 1, 2, 3, 0, 1]),
}


@pytest.mark.parametrize("name", NESTED_OPS)
def test_row_ops_carry_nested_tensordicts(name):
    op, want = NESTED_OPS[name]
    got = op(nested_batch())
    assert a_of(got) == want
    assert got.batch["sub", "x"].shape == (len(want), 2)
    assert list(got.non_tensor_batch["s"]) == ["wxyz"[i] for i in want]
