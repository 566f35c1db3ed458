"""Custom resources in the scheduler's model: nodes register them, placement groups take
them from the snapshot, workers take them from their bundle; bad ones change nothing."""

from __future__ import annotations

import pytest

from podium import errors
from podium.scheduler.state import ClusterModel
from podium.v1 import common_pb2
from podium.worker.agent.config import build_parser, config_from_args, parse_resources_arg


def _node(n: int, **resources: float) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id=f"node-{n}", address=f"10.0.0.{n}", agent_port=7000 + n, cpus=8,
                               resources=resources)


def _spec(pg_id: str, rank: int, **resources: float) -> common_pb2.WorkerSpec:
    return common_pb2.WorkerSpec(name=f"w{rank}", group="g", placement_group_id=pg_id, bundle_index=0,
                                 num_cpus=1, rank=rank, world_size=4, resources=resources)


def test_groups_take_custom_resources_of_the_nodes_that_offer_them() -> None:
    model = ClusterModel(node_lease=10, default_session_lease=30)
    model.register_node(_node(1), [], now=0)
    model.register_node(_node(2, nvlink_domain_0=1), [], now=0)
    a = model.create_placement_group("a", [{"CPU": 1, "nvlink_domain_0": 1}], 1, False, "", now=1)
    assert a.state == common_pb2.PG_CREATED and a.placements[0].node_id == "node-2"
    b = model.create_placement_group("b", [{"CPU": 1, "nvlink_domain_0": 1}], 1, False, "", now=1)
    assert b.state == common_pb2.PG_PENDING and "nvlink_domain_0" in b.reason
    with pytest.raises(errors.InfeasibleError, match="nvlink_domain_0"):
        model.create_placement_group("c", [{"CPU": 1, "nvlink_domain_0": 2}], 1, False, "", now=1)
    model.remove_placement_group(a.id, now=2)
    assert model.groups[b.id].state == common_pb2.PG_CREATED


def test_workers_take_custom_resources_from_their_bundle() -> None:
    model = ClusterModel(node_lease=10, default_session_lease=30)
    model.register_node(_node(1, accel=2), [], now=0)
    pg = model.create_placement_group("p", [{"CPU": 4, "accel": 1}], 1, False, "", now=1)
    model.create_workers([_spec(pg.id, 0, accel=0.5)], "", 0, 29500, now=1)
    with pytest.raises(errors.SlotFullError, match="accel"):
        model.create_workers([_spec(pg.id, 1, accel=0.75)], "", 0, 29500, now=2)
    with pytest.raises(errors.InvalidSpecError, match="other"):
        model.create_workers([_spec(pg.id, 1, other=1)], "", 0, 29500, now=2)
    model.create_workers([_spec(pg.id, 1, accel=0.5)], "", 0, 29500, now=2)


def test_a_node_with_bad_resources_is_refused() -> None:
    model = ClusterModel(node_lease=10, default_session_lease=30)
    for bad in ({"bad name": 1}, {"x": -1}, {"x": float("nan")}):
        with pytest.raises(errors.InvalidArgumentError):
            model.register_node(_node(1, **bad), [], now=0)
    assert not model.nodes


def test_podium_node_resources_flag() -> None:
    args = build_parser().parse_args(["--scheduler", "127.0.0.1:1", "--resources", '{"nvlink_domain_0": 1}'])
    assert config_from_args(args).resources == {"nvlink_domain_0": 1.0}
    assert parse_resources_arg(None) == {}
    for bad in ("nope", "[1]", '{"CPU": 1}', '{"x": -1}', '{"a b": 1}'):
        with pytest.raises(errors.InvalidArgumentError):
            parse_resources_arg(bad)
