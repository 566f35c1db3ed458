"""The process-group weight carrier's rendezvous against a client with no key (issue #48).

A sender and a replica in threads of this process, on gloo; the attacker is what anyone on
the network has: torch's own ``TCPStore`` client and raw sockets. Before the fix the
rendezvous was a ``TCPStore`` on every interface: a forged END record made the replica accept
an empty update, and any client could store what it liked there."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch

from podium.errors import AuthenticationError, ResourceExhaustedError
from podium.rollout.broadcastcollective import CollectiveReceiver, CollectiveSender
from podium.transport import authstore

pytestmark = pytest.mark.timeout(120)


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)}


def _replica(meta: dict, out: list) -> None:
    receiver = CollectiveReceiver(name="r", timeout=20)
    try:
        receiver.join(meta, 1)
        out.append({name: tensor.clone() for name, tensor in receiver.receive(1)})
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        out.append(exc)


def _torch_client_writes(meta: dict, key: str, value: str) -> bool:
    """Whether torch's TCPStore client, with no key, could write ``key`` into the rendezvous."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(meta["host"], meta["port"], is_master=False,
                              timeout=datetime.timedelta(seconds=3))
        store.set(key, value)
        return True
    except (RuntimeError, OSError):
        return False


def test_a_forged_end_record_from_a_client_without_the_key_is_never_read():
    sender = CollectiveSender(replicas=1, bucket_bytes=4 << 10, timeout=20, backend="gloo")
    meta = sender.prepare()
    try:
        # Update 1's first record, an END of nothing, written before the sender writes its own.
        forged = _torch_client_writes(meta, "record/1/0", '{"end": true, "tensors": 0, "bytes": 0, '
                                                          '"buckets": 0, "step": 1}')
        big = _torch_client_writes(meta, "parked", "x" * (8 << 20))
        out: list = []
        thread = threading.Thread(target=_replica, args=(meta, out))
        thread.start()
        sent = sender.send(_state().items(), 1)
        thread.join(60)
        got = out[0]
        assert not isinstance(got, Exception), got
        assert sorted(got) == ["b", "w"] and torch.equal(got["w"], _state()["w"])  # not an empty update
        assert sent["tensors"] == 2
        assert not forged and not big
    finally:
        sender.close()


def test_the_rendezvous_listens_only_on_the_address_it_was_given():
    sender = CollectiveSender(replicas=1, timeout=20, backend="gloo", host="127.0.0.1")
    meta = sender.prepare()
    try:
        with socket.create_connection(("127.0.0.1", meta["port"]), timeout=5):
            pass
        with pytest.raises(ConnectionRefusedError):  # another address of this host: nothing there
            socket.create_connection(("127.0.0.2", meta["port"]), timeout=5).close()
    finally:
        sender.close()


def test_bytes_without_the_key_are_bounded_and_idle_sockets_do_not_lock_ranks_out():
    key = authstore.new_key()
    server = authstore.StoreServer("127.0.0.1", key)
    idle: list[socket.socket] = []
    try:
        # A client that never answers the challenge and floods it: the server reads its 64
        # bytes, closes, and the rest of the flood meets a closed connection.
        flood = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        flood.recv(36)
        with pytest.raises(OSError):
            for _ in range(64):
                flood.sendall(b"\0" * (1 << 20))
        flood.close()
        # More idle connections than the pending bound, then a rank: it gets in, and stores.
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
                for _ in range(authstore.MAX_PENDING + 16)]
        client = authstore.StoreClient("127.0.0.1", server.port, key, 10)
        client.set("k", b"v")
        assert client.get("k") == b"v" and client.num_keys() == 1
        # The oldest idle ones were closed to make room.
        idle[0].settimeout(10)
        assert idle[0].recv(36)[:4] == b"PDKS" and idle[0].recv(1) == b""
        with pytest.raises(AuthenticationError):
            authstore.StoreClient("127.0.0.1", server.port, authstore.new_key(), 10)
        assert client.num_keys() == 1
        client.close()
        # And a rank never talks to a store that does not hold its key (another group's).
        other = authstore.StoreServer("127.0.0.1", authstore.new_key())
        try:
            with pytest.raises(AuthenticationError, match="this group's key"):
                authstore.StoreClient("127.0.0.1", other.port, key, 10)
        finally:
            other.close()
    finally:
        for sock in idle:
            sock.close()
        server.close()


def test_a_key_holder_is_bounded_too():
    key = authstore.new_key()
    server = authstore.StoreServer("127.0.0.1", key)
    client = authstore.StoreClient("127.0.0.1", server.port, key, 10)
    try:
        value = b"x" * (authstore.MAX_VALUE_BYTES - 64)
        with pytest.raises(ResourceExhaustedError, match="the store is full"):
            for i in range(authstore.MAX_STORE_BYTES // len(value) + 2):
                client.set(f"k{i}", value)
        assert client.num_keys() == authstore.MAX_STORE_BYTES // len(value)
        client.delete_key("k0")
        client.set("k0", value)  # room again once a key is gone
    finally:
        client.close()
        server.close()
