"""NodeTable alone: registration checks, heartbeat readings, leases, death, and the capacity
epoch that tells a kept snapshot it is stale."""

import pytest

from podium import errors
from podium.scheduler.nodes import NodeTable
from podium.scheduler.tables import ChangeLog
from podium.v1 import common_pb2


def _info(n, gpus=2, cpus=8.0, address=None, **kw):
    return common_pb2.NodeInfo(node_id=f"n{n}", address=address or f"10.0.0.{n}", agent_port=7000 + n,
                               cpus=cpus, gpus=[common_pb2.GpuInfo(index=i, uuid=f"G{n}{i}",
                                                                   memory_total_bytes=80)
                                                for i in range(gpus)], **kw)


def _table(lease=10.0):
    changes = ChangeLog()
    return NodeTable(changes, lease=lease), changes


@pytest.mark.parametrize("bad, match", [
    ({"node_id": ""}, "node_id is required"),
    ({"address": ""}, "address is required"),
    ({"agent_port": 70000}, "not a TCP port"),
    ({"cpus": float("nan")}, "cpus"),
])
def test_bad_registrations_change_nothing(bad, match):
    table, changes = _table()
    info = _info(1)
    for field, value in bad.items():
        setattr(info, field, value)
    with pytest.raises(errors.InvalidArgumentError, match=match):
        table.register(info, now=0)
    assert not table and not changes.pending() and table.capacity_epoch == 0


def test_duplicate_gpu_indices_are_refused():
    table, _ = _table()
    info = _info(1)
    info.gpus[1].index = 0
    with pytest.raises(errors.InvalidArgumentError, match="distinct"):
        table.register(info, now=0)


def test_alive_is_in_address_order_and_lookup_names_an_unknown_node():
    table, _ = _table()
    for n, address in ((1, "10.0.0.10"), (2, "10.0.0.9"), (3, "10.0.0.100")):
        table.register(_info(n, address=address), now=0)
    assert [n.info.node_id for n in table.alive()] == ["n2", "n1", "n3"]
    with pytest.raises(errors.NotFoundError, match="'nope'"):
        table.lookup("nope")


def test_the_capacity_epoch_moves_only_when_capacity_does():
    table, _ = _table()
    table.register(_info(1), now=0)
    epoch = table.capacity_epoch
    table.register(_info(1), now=1)  # the same node again: a re-registration storm
    assert table.capacity_epoch == epoch
    table.register(_info(1, gpus=3), now=2)
    assert table.capacity_epoch == epoch + 1
    assert table.beat("n1", [common_pb2.GpuInfo(index=0, memory_used_bytes=5)], [], now=3)
    assert table.capacity_epoch == epoch + 1  # memory used is a reading, not capacity
    table.beat("n1", [common_pb2.GpuInfo(index=0, memory_total_bytes=40)], [], now=4)
    assert table.capacity_epoch == epoch + 2
    table.mark_dead(table["n1"])
    assert table.capacity_epoch == epoch + 3


def test_beats_store_readings_in_batches_and_keep_processes_across_registration():
    table, changes = _table()
    table.register(_info(1), now=0)
    changes.take()
    version = changes.version
    proc = common_pb2.ProcessMemory(pid=42)
    assert table.beat("n1", [common_pb2.GpuInfo(index=1, memory_used_bytes=9)], [proc], now=4)
    node = table["n1"]
    assert node.last_heartbeat == 4 and node.info.gpus[1].memory_used_bytes == 9
    assert list(node.processes) == [proc]
    assert not changes.pending() and changes.version == version  # no transaction per beat
    assert table.take_readings() == {"n1": None} and table.take_readings() == {}
    table.register(_info(1), now=5)
    assert list(table["n1"].processes) == [proc]


def test_a_dead_or_unknown_node_must_register_again():
    table, _ = _table()
    assert not table.beat("n1", [], [], now=0)
    table.register(_info(1), now=0)
    table.mark_dead(table["n1"])
    assert table["n1"].state == common_pb2.NODE_DEAD and not table.beat("n1", [], [], now=1)
    assert not table.any_alive() and table.take_readings() == {}


def test_overdue_counts_silence_from_the_later_of_the_last_beat_and_since():
    table, _ = _table(lease=10)
    table.register(_info(1), now=0)
    table.register(_info(2), now=0)
    table.beat("n2", [], [], now=8)
    assert [n.info.node_id for n in table.overdue(now=11, since=0)] == ["n1"]
    assert table.overdue(now=11, since=5) == []
    table.mark_dead(table["n1"])
    assert table.overdue(now=30, since=0) == [table["n2"]]  # a dead node is not overdue again


def test_restore_renews_alive_nodes_only():
    old, _ = _table()
    old.register(_info(1), now=0)
    old.register(_info(2), now=0)
    old.mark_dead(old["n2"])
    table, _ = _table()
    table.restore([old["n1"], old["n2"]], now=50)
    assert table["n1"].last_heartbeat == 50 and table["n2"].last_heartbeat == 0
    assert table.any_alive() and [n.info.node_id for n in table.alive()] == ["n1"]
