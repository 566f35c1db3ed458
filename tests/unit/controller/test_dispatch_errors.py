"""Dispatch's checks raise InvalidArgumentAssertion with the numbers: a PodiumError users can
act on that verl code's ``except AssertionError`` still catches, and that ``python -O``
(which strips ``assert`` statements) keeps."""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import podium
from podium.controller.dispatch import modes as d
from podium.dataproto import DataProto
from podium.errors import InvalidArgumentAssertion, InvalidArgumentError, PodiumError


def group(ws: int):
    return types.SimpleNamespace(world_size=ws)


def test_a_tensordict_that_does_not_divide_names_its_rows_and_chunks():
    with pytest.raises(InvalidArgumentAssertion, match=r"10 rows cannot be split into 4 equal chunks \(10 % 4 = 2"):
        d.split_tensordict(TensorDict({"a": torch.zeros(10)}, batch_size=[10]), 4)


def test_dp_compute_names_the_world_size_and_the_length():
    with pytest.raises(InvalidArgumentAssertion, match="world_size=4 items, got list of length 3"):
        d.dispatch_dp_compute(group(4), [1, 2, 3])
    with pytest.raises(InvalidArgumentAssertion, match="expected 4 outputs, got 3"):
        d.collect_dp_compute(group(4), [1, 2, 3])


def test_padded_arguments_of_different_lengths_name_both():
    def padded(n):
        return DataProto.from_dict(tensors={"a": torch.zeros(n)}, auto_padding=True)

    with pytest.raises(InvalidArgumentAssertion, match="10 != 7 rows"):
        d.dispatch_dp_compute_data_proto(group(4), padded(10), padded(7))


def test_modes_that_do_not_exist_say_what_is_accepted():
    with pytest.raises(InvalidArgumentAssertion, match="a Dispatch member or a dict"):
        d._check_dispatch_mode("DP")
    with pytest.raises(InvalidArgumentAssertion, match="Execute.ALL or Execute.RANK_ZERO"):
        d._check_execute_mode(3)
    with pytest.raises(InvalidArgumentError, match="DP_COMPUTE already registered in Dispatch"):
        d.register_dispatch_mode("DP_COMPUTE", d.dispatch_all_to_all, d.collect_all_to_all)
    with pytest.raises(InvalidArgumentAssertion, match="'DP' not found: register it first"):
        d.update_dispatch_mode("DP", d.dispatch_all_to_all, d.collect_all_to_all)


def test_verl_style_except_assertion_error_still_catches():
    caught = None
    try:
        d.dispatch_dp_compute(group(2), np.zeros(3))
    except AssertionError as exc:  # what verl code writes around its own asserts
        caught = exc
    assert isinstance(caught, InvalidArgumentError) and isinstance(caught, PodiumError)
    assert isinstance(caught, podium.InvalidArgumentAssertion)


def test_the_checks_survive_python_dash_o():
    code = ("import types\nfrom podium.controller.dispatch import modes as d\n"
            "try:\n    d.dispatch_dp_compute(types.SimpleNamespace(world_size=4), [1])\n"
            "except AssertionError as exc:\n    print(type(exc).__name__, exc)\n")
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("InvalidArgumentAssertion DP_COMPUTE needs every argument"), done.stdout


def test_docs_name_the_error_a_length_that_does_not_divide_raises():
    import re

    from tests.support.waiting import REPO
    text = (REPO / "docs" / "dispatch.md").read_text()
    named = re.search(r"a length that does not\s+divide is an `(\w+)`", text)
    assert named, "docs/dispatch.md no longer says what a length that does not divide raises"
    data = DataProto.from_dict(tensors={"a": torch.zeros(10)})
    with pytest.raises(getattr(podium.errors, named.group(1))):
        d.dispatch_dp_compute_data_proto(group(4), data)
