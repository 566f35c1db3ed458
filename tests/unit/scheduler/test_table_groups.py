"""GroupTable alone, over a real NodeTable and SessionTable: placement, pending and promotion,
removal, the kept capacity snapshot, names, owners and pruning."""

import itertools

import pytest

from podium import errors
from podium.scheduler.groups import GroupTable
from podium.scheduler.nodes import NodeTable
from podium.scheduler.sessions import SessionTable
from podium.scheduler.tables import ChangeLog
from podium.v1 import common_pb2

GPU = {"CPU": 1, "GPU": 1}


def _info(n, gpus=2):
    return common_pb2.NodeInfo(node_id=f"n{n}", address=f"10.0.0.{n}", agent_port=7000 + n, cpus=8,
                               gpus=[common_pb2.GpuInfo(index=i, uuid=f"G{n}{i}") for i in range(gpus)])


def _tables(nodes=(1,)):
    changes = ChangeLog()
    counter = itertools.count()
    new_id = lambda prefix: f"{prefix}-{next(counter)}"  # noqa: E731
    node_table = NodeTable(changes)
    sessions = SessionTable(changes, new_id=new_id)
    for n in nodes:
        node_table.register(_info(n), now=0)
    return GroupTable(changes, node_table, sessions, new_id=new_id), node_table, sessions, changes


def test_a_group_that_fits_is_created_on_the_nodes_with_their_gpu_uuids():
    groups, _, _, changes = _tables()
    changes.take()
    group = groups.create("g", [GPU, GPU], common_pb2.PACK, True, "", now=1)
    assert group.state == common_pb2.PG_CREATED and groups.lookup(group.id) is group
    assert [(p.node_id, list(p.gpu_uuids)) for p in group.placements] == [("n1", ["G10"]), ("n1", ["G11"])]
    assert list(changes.take().groups) == [group.id]
    assert len(groups.bundles(group.id)) == 2 and groups.bundles(group.id)[0].gpu_units > 0
    assert groups.snapshot().nodes[0].gpus[0].free_units == 0


def test_pending_until_capacity_frees_then_promoted_in_creation_order():
    groups, _, _, _ = _tables()
    first = groups.create("first", [GPU, GPU], common_pb2.PACK, True, "", now=1)
    second = groups.create("second", [GPU], common_pb2.PACK, True, "", now=2)
    third = groups.create("third", [GPU], common_pb2.PACK, True, "", now=3)
    assert (second.state, third.state) == (common_pb2.PG_PENDING, common_pb2.PG_PENDING)
    assert "n1" in second.reason and groups.pending_text(second) == second.reason
    groups.remove(first, "done")
    assert first.state == common_pb2.PG_REMOVED and first.reason == "done"
    assert groups.promote_pending() == [second.id, third.id]


def test_no_alive_node_is_pending_and_a_new_node_is_a_fresh_snapshot():
    groups, nodes, _, _ = _tables(nodes=())
    group = groups.create("g", [GPU], common_pb2.PACK, True, "", now=1)
    assert group.state == common_pb2.PG_PENDING and group.reason == "no alive nodes"
    before = groups.snapshot()
    nodes.register(_info(2), now=2)
    assert groups.snapshot() is not before  # the nodes' capacity epoch moved
    assert groups.promote_pending() == [group.id] and group.placements[0].node_id == "n2"


def test_the_kept_snapshot_equals_one_built_from_the_records():
    groups, nodes, _, _ = _tables(nodes=(1, 2))
    a = groups.create("a", [GPU] * 3, common_pb2.SPREAD, True, "", now=1)
    groups.create("b", [{"CPU": 2, "GPU": 0.5}], common_pb2.PACK, True, "", now=2)
    assert groups.snapshot() == groups.build_snapshot()
    groups.remove(a, "gone")
    assert groups.snapshot() == groups.build_snapshot()
    kept = groups.snapshot()
    nodes.register(_info(1), now=3)  # same capacity: nothing to rebuild
    assert groups.snapshot() is kept


def test_never_fits_is_infeasible_and_records_nothing():
    groups, _, _, changes = _tables()
    changes.take()
    with pytest.raises(errors.InfeasibleError, match="can never fit"):
        groups.create("huge", [GPU] * 3, common_pb2.STRICT_PACK, True, "", now=1)
    assert not groups and not changes.pending()


def test_names_owners_and_bad_input():
    groups, _, sessions, _ = _tables()
    with pytest.raises(errors.NotFoundError, match="session"):
        groups.create("g", [GPU], common_pb2.PACK, False, "s-unknown", now=1)
    session = sessions.open("ctl", 10, now=0)
    owned = groups.create("g", [GPU], common_pb2.PACK, False, session.id, now=1)
    detached = groups.create("d", [GPU], common_pb2.PACK, True, session.id, now=1)
    assert owned.owner == session.id and detached.owner == ""
    assert groups.owned_by(session.id) == [owned]
    with pytest.raises(errors.AlreadyExistsError):
        groups.create("g", [GPU], common_pb2.PACK, True, "", now=2)
    with pytest.raises(errors.InvalidArgumentError, match="exactly one"):
        groups.lookup()
    groups.remove(owned, "closed")
    again = groups.create("g", [GPU], common_pb2.PACK, True, "", now=3)
    assert groups.lookup(name="g") is again and groups.owned_by(session.id) == []


def test_placed_on_and_prune_keep_the_newest_removed():
    groups, _, _, changes = _tables(nodes=(1, 2))
    made = [groups.create(f"g{i}", [GPU], common_pb2.PACK, True, "", now=i) for i in range(3)]
    on = {p.node_id for g in made for p in g.placements}
    assert sorted(g.id for n in on for g in groups.placed_on(n)) == sorted(g.id for g in made)
    for group in made:
        groups.remove(group, "x")
    changes.take()
    groups.prune(keep=1)
    assert list(groups) == [made[2].id] and list(changes.take().groups) == [made[0].id, made[1].id]


def test_restore_keeps_creation_order_and_live_names():
    old, _, _, _ = _tables()
    a = old.create("a", [GPU], common_pb2.PACK, True, "", now=1)
    b = old.create("b", [GPU], common_pb2.PACK, True, "", now=2)
    old.remove(a, "x")
    groups, _, _, _ = _tables()
    groups.restore([b, a])
    assert list(groups) == [a.id, b.id] and groups.lookup(name="b") is b
    assert groups.snapshot() == groups.build_snapshot()
