"""``Rendezvous.store()``: the Podium store a WorkerGroup's rank 0 serves for each rendezvous
version (issue 51: the store listens only on the node address), used here as torch uses it."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest

from podium import errors
from podium.worker import rendezvous as rdzv

torch = pytest.importorskip("torch")
dist = torch.distributed


def _version(version: int, host: str = "127.0.0.1") -> rdzv.Rendezvous:
    """Rank 0's side of a new version (what RankReplacer runs in rank 0), as rank 0 sees it."""
    port, store_port, key = rdzv.open_port(object(), host)
    return rdzv.Rendezvous(version, 0, 2, host, port, f"g.v{version}", store_port, key)


def test_each_version_serves_its_own_store_on_the_node_address_only():
    first = _version(1)
    try:
        assert first.store_port > 0 and first.store_key not in repr(first)  # the key is not logged
        store = first.store(timeout=10)
        assert first.store(timeout=10) is store  # one client per version and process
        other = rdzv.Rendezvous(1, 1, 2, first.master_addr, first.master_port, first.group_name,
                                first.store_port, first.store_key)
        store.set("a", b"1")
        assert other.store(timeout=10).get("a") == b"1"
        with pytest.raises(ConnectionRefusedError):  # not on the host's other addresses (TCPStore is)
            socket.create_connection(("127.0.0.2", first.store_port), timeout=5).close()
        wrong = rdzv.Rendezvous(9, 1, 2, first.master_addr, 0, "", first.store_port, "00" * 32)
        with pytest.raises(errors.AuthenticationError):
            wrong.store(timeout=10)

        second = _version(2)  # the next version: a new store, the old one closed
        assert second.store_port != first.store_port and second.store_key != first.store_key
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((first.master_addr, first.store_port), timeout=5).close()
        ranks = [second, rdzv.Rendezvous(2, 1, 2, second.master_addr, second.master_port, second.group_name,
                                         second.store_port, second.store_key)]
        # Two process groups from two threads (one process: they share its client of the version).
        groups: list = [None, None]

        def join(r: rdzv.Rendezvous) -> None:
            prefix = dist.PrefixStore(f"rank-test/{r.group_name}", r.store(timeout=30))
            groups[r.rank] = dist.ProcessGroupGloo(prefix, r.rank, r.world_size, datetime.timedelta(seconds=30))

        threads = [threading.Thread(target=join, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        tensors = [torch.tensor([1.0]), torch.tensor([2.0])]
        works = [g.allreduce([t]) for g, t in zip(groups, tensors)]
        for w in works:
            w.wait()
        assert [t.item() for t in tensors] == [3.0, 3.0]
    finally:
        if rdzv._server is not None:
            rdzv._server.close()
            rdzv._server = None
        if rdzv._held is not None:
            rdzv._held.close()
            rdzv._held = None


def test_a_version_without_a_store_says_what_to_use():
    bare = rdzv.Rendezvous(1, 0, 2, "127.0.0.1", 29500, "g.v1")
    with pytest.raises(errors.FailedPreconditionError, match="init_method"):
        bare.store()
