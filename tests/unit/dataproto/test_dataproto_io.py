"""DataProto's verl methods from issue 17: TensorDict round trip, disk round trip,
get_data_info, print_size and unfold_column_chunks (verl's semantics)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack

from podium.dataproto import DataProto
from podium.errors import InvalidArgumentError


def sample() -> DataProto:
    return DataProto.from_dict(
        tensors={"ids": torch.arange(12).reshape(4, 3), "mask": torch.ones(4, 2, dtype=torch.bool)},
        non_tensors={"uid": np.array(["a", "b", "c", "d"], dtype=object),
                     "pair": np.arange(8).reshape(4, 2)},
        meta_info={"temperature": 0.7, "step": 3})


def same(a: DataProto, b: DataProto) -> None:
    assert a.batch.keys() == b.batch.keys()
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key])
    assert a.non_tensor_batch.keys() == b.non_tensor_batch.keys()
    for key in a.non_tensor_batch:
        assert a.non_tensor_batch[key].tolist() == b.non_tensor_batch[key].tolist()
    assert a.meta_info == b.meta_info


def test_tensordict_round_trip():
    data = sample()
    td = data.to_tensordict()
    assert td.batch_size == torch.Size([4])
    assert isinstance(td.get("uid"), NonTensorStack) and td.get("uid").tolist() == ["a", "b", "c", "d"]
    assert isinstance(td.get("temperature"), NonTensorData)
    back = DataProto.from_tensordict(td)
    assert back.non_tensor_batch["uid"].dtype == object
    back.non_tensor_batch["pair"] = np.array(back.non_tensor_batch["pair"].tolist())
    same(back, data)


def test_to_tensordict_refuses_a_key_in_two_places():
    data = sample()
    data.meta_info["ids"] = 1
    with pytest.raises(InvalidArgumentError, match="ids"):
        data.to_tensordict()
    with pytest.raises(InvalidArgumentError):
        DataProto.from_tensordict({"ids": torch.ones(2)})


def test_save_and_load_from_disk(tmp_path):
    data = sample()
    path = tmp_path / "batch.pkl"
    data.save_to_disk(path)
    same(DataProto.load_from_disk(path), data)


def test_get_data_info_and_print_size(capsys):
    info = sample().get_data_info()
    assert info.splitlines()[0] == "batch"
    assert "  ids: (4, 3) (torch.int64) cpu" in info
    assert "  uid: ndarray(4,) (object) of str" in info
    assert "  temperature: float" in info
    sample().print_size(prefix="rollout")
    out = capsys.readouterr().out
    assert out.startswith("rollout, Size of tensordict: ")
    assert f"{(12 * 8 + 8) / 1024 ** 3} GB" in out


def test_unfold_column_chunks_splits_the_named_keys_and_repeats_the_rest():
    data = sample()
    out = data.unfold_column_chunks(2, split_keys=["mask", "pair"])
    assert len(out) == 8
    assert out.batch["mask"].shape == (8, 1)
    assert out.non_tensor_batch["pair"].tolist() == [[0], [1], [2], [3], [4], [5], [6], [7]]
    # not split: each row repeated n_split times, in place
    assert torch.equal(out.batch["ids"], torch.repeat_interleave(data.batch["ids"], 2, dim=0))
    assert out.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert out.meta_info is data.meta_info
    everything_repeated = data.unfold_column_chunks(2)
    assert len(everything_repeated) == 8
    with pytest.raises(InvalidArgumentError, match="ids"):
        data.unfold_column_chunks(2, split_keys=["ids"])  # 3 columns do not split in 2
    with pytest.raises(InvalidArgumentError):
        data.unfold_column_chunks(0)
