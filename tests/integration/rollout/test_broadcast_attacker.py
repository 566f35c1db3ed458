"""A replica's weight-broadcast listener against connections without the update's token
(issue #48), on real loopback sockets: before the fix the first connection, a port scan
included, took the upstream's place and failed the update."""

from __future__ import annotations

import socket

import pytest
import torch

from podium.errors import DataLossError
from podium.rollout import broadcast, broadcastshm
from podium.rollout.broadcast import WeightReceiver, WeightSender
from tests.support.rollout_kit import receive_in_thread

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_segments_left():
    yield
    broadcastshm.SENDER.close()


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(5000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64)}


def _connect(meta: dict) -> socket.socket:
    return socket.create_connection((meta["host"], meta["port"]), timeout=10)


def test_connections_without_the_token_never_fail_the_update():
    receiver = WeightReceiver(name="r", timeout=30)
    meta = receiver.prepare()
    attackers: list[socket.socket] = []
    thread, out = receive_in_thread(receiver, step=1)
    try:
        _connect(meta).close()  # a port scan: connect, and leave
        wrong = _connect(meta)  # a HELLO with another token
        wrong.sendall(broadcast._frame_head(broadcast._HELLO, {"token": "0" * 32, "step": 1}))
        deep = _connect(meta)  # a HELLO nested past the JSON parser's depth
        body = b"[" * (broadcast.MAX_HELLO_BYTES - 1)
        deep.sendall(broadcast._HEADER.pack(b"PDWB", broadcast._HELLO, len(body), 0) + body)
        big = _connect(meta)  # a HELLO over the bound, announced
        big.sendall(broadcast._HEADER.pack(b"PDWB", broadcast._HELLO, 1 << 30, 0))
        # More silent connections than the listener holds at once.
        attackers = [wrong, deep, big, *(_connect(meta) for _ in range(broadcast.MAX_UNAUTHENTICATED + 8))]
        sent = WeightSender(timeout=30).send(_state().items(), meta, step=1)
        thread.join(60)
        assert sent["tensors"] == 2
        got = dict(out[0]) if isinstance(out[0], list) else out[0]
        assert isinstance(got, dict), got
        assert torch.equal(got["w"], _state()["w"]) and torch.equal(got["b"], _state()["b"])
        # The ones that sent something wrong were closed, without a byte in answer.
        for sock in (wrong, deep, big):
            assert sock.recv(1) == b""
    finally:
        for sock in attackers:
            sock.close()


def test_deep_json_from_the_upstream_is_a_typed_error_and_a_failed_update_frees_its_buffers():
    receiver = WeightReceiver(name="r", timeout=10)
    meta = receiver.prepare()
    thread, out = receive_in_thread(receiver)
    WeightSender(timeout=10).send(_state().items(), dict(meta, shm_domain=""))  # bytes over TCP, staged here
    thread.join(30)
    assert isinstance(out[0], list) and receiver._buffers  # staged for the next update
    meta = receiver.prepare()
    thread, out = receive_in_thread(receiver)
    body = b"[" * 100_000
    with _connect(meta) as upstream:
        upstream.sendall(broadcast._frame_head(broadcast._HELLO, {"token": meta["token"], "step": None}))
        upstream.sendall(broadcast._HEADER.pack(b"PDWB", broadcast._BUCKET, len(body), 64) + body)
        thread.join(30)
    assert isinstance(out[0], DataLossError) and "nested too deep" in str(out[0]), out
    assert receiver._buffers == [] and receiver._mapped == {}
