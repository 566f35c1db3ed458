"""The weight broadcast's stream on real loopback sockets: a chain of receivers in threads,
and peers that send the wrong token, cut the stream, lie in a manifest or stall."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest
import torch

from podium.errors import DataLossError, InvalidArgumentError, UnavailableError
from podium.rollout import broadcast, broadcastshm
from podium.rollout.broadcast import WeightReceiver, WeightSender, build_topology
from podium.transport import shm
from tests.support.rollout_kit import receive_in_thread

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_segments_left():
    # The senders here run in the test process, which keeps its segments for the next update
    # (broadcastshm.SENDER): other tests check that this process leaves no segment behind.
    yield
    broadcastshm.SENDER.close()


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"f32": torch.randn(300, 7, generator=gen), "bf16": torch.randn(33, generator=gen).to(torch.bfloat16),
            "i64": torch.arange(1001), "flag": torch.tensor([True, False, True]),
            "strided": torch.randn(40, 30, generator=gen).t()}  # not contiguous: sent as its values


def _segments_of_this_process() -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"{shm.PREFIX}{os.getpid()}-"))


@pytest.mark.parametrize("links", ["tcp", "shm", "mixed"])
def test_a_chain_of_four_gets_every_dtype_exactly_and_reuses_its_buffers(links, monkeypatch):
    # tcp: every link a stream of bytes; shm: one host, so the buckets go as segment names;
    # mixed: replica 2 counts as on another host, so replica 1 forwards it the bytes (and
    # replica 2 streams them on to 3).
    if links == "tcp":
        monkeypatch.setenv("PODIUM_DISABLE_SHM", "1")
    broadcastshm.SENDER.close()
    others = _segments_of_this_process()  # what other tests in this process hold
    receivers = [WeightReceiver(name=f"r{i}", timeout=30) for i in range(4)]
    for step in (1, 2):
        metadata = [r.prepare() for r in receivers]
        if links == "mixed":
            metadata[2]["shm_domain"] = ""
        head, downs = build_topology(metadata)
        threads = [receive_in_thread(r, d, step) for r, d in zip(receivers, downs)]
        state = {k: v + step if v.dtype != torch.bool else v for k, v in _state().items()}
        sent = WeightSender(bucket_bytes=4 << 10, timeout=30).send(state.items(), head, step)
        assert sent["tensors"] == len(state) and sent["buckets"] >= 3
        for thread, out in threads:
            thread.join(30)
            got = dict(out[0])
            assert list(got) == list(state)
            for name, tensor in state.items():
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        # Raw buckets are read into each receiver's own buffers; segments are mapped.
        assert [bool(r._buffers) for r in receivers] == {"tcp": [True] * 4, "shm": [False] * 4,
                                                          "mixed": [False, False, True, True]}[links]
        segments = [n for n in _segments_of_this_process() if n not in others]
        assert len(segments) == (0 if links == "tcp" else sent["buckets"])  # kept for the next update
        if step == 1:
            first = [b.data_ptr() for b in receivers[3]._buffers]
            first_segments = segments
        else:
            assert [b.data_ptr() for b in receivers[3]._buffers] == first  # same layout: same buffers
            assert segments == first_segments  # and the same segments, rewritten
    assert all(r.downstream_error is None for r in receivers)
    broadcastshm.SENDER.close()
    assert _segments_of_this_process() == others


def test_a_segment_name_from_a_peer_is_checked():
    # A shared-memory upstream that names a path outside /dev/shm, or a missing segment.
    for name, why in (("../etc/passwd", "cannot be mapped"), (f"{shm.PREFIX}1-gone", "cannot be mapped")):
        receiver = WeightReceiver(name="r", timeout=10)
        meta = receiver.prepare()
        thread, out = receive_in_thread(receiver)
        hello = broadcast._frame_head(broadcast._HELLO, {"token": meta["token"], "step": None,
                                                         "shm_domain": meta["shm_domain"]})
        entry = ["w", "float32", [2], 0, 8]
        bucket = broadcast._frame_head(broadcast._BUCKET, {"tensors": [entry], "shm": name, "size": 64})
        with _raw_peer(meta, [hello, bucket]):
            thread.join(10)
        assert isinstance(out[0], DataLossError) and why in str(out[0]), out


def test_a_wrong_token_is_refused_and_hands_over_nothing():
    receiver = WeightReceiver(name="r", timeout=2)
    meta = receiver.prepare()
    thread, out = receive_in_thread(receiver)
    with pytest.raises((UnavailableError, DataLossError)):
        WeightSender(timeout=10).send(_state().items(), dict(meta, token="0" * 32))
    thread.join(10)
    # The connection was closed; the receiver waited for the real upstream until its timeout.
    assert isinstance(out[0], UnavailableError) and "did not present replica r's token" in str(out[0])


def _raw_peer(meta: dict, frames: list[bytes]) -> socket.socket:
    sock = socket.create_connection((meta["host"], meta["port"]), timeout=10)
    for frame in frames:
        sock.sendall(frame)
    return sock


def _hello(meta: dict, step=None) -> bytes:
    return broadcast._frame_head(broadcast._HELLO, {"token": meta["token"], "step": step})


def test_a_stream_cut_mid_bucket_leaves_the_previous_weights():
    receiver = WeightReceiver(name="r", timeout=10)
    meta = receiver.prepare()
    thread, out = receive_in_thread(receiver)
    entries = [["w", "float32", [1024], 0, 4096]]
    sock = _raw_peer(meta, [_hello(meta), broadcast._frame_head(broadcast._BUCKET, {"tensors": entries}, 4096),
                            bytes(1000)])
    sock.close()
    thread.join(10)
    assert isinstance(out[0], UnavailableError) and "short of a bucket" in str(out[0])


@pytest.mark.parametrize("entry, why", [
    (["w", "float32", [2000], 0, 8000], "does not fit"),  # past the bucket's end
    (["w", "complex128", [10], 0, 160], "does not fit"),  # a dtype the stream does not carry
    (["w", "float32", [10], 3, 40], "does not fit"),  # unaligned
    (["w", "float32", [11], 0, 40], "does not fit"),  # shape and size disagree
    ("w", "does not fit"),
])
def test_a_manifest_that_lies_is_refused(entry, why):
    receiver = WeightReceiver(name="r", timeout=10)
    meta = receiver.prepare()
    thread, out = receive_in_thread(receiver)
    sock = _raw_peer(meta, [_hello(meta), broadcast._frame_head(broadcast._BUCKET, {"tensors": [entry]}, 4096),
                            bytes(4096)])
    thread.join(10)
    sock.close()
    assert isinstance(out[0], DataLossError) and why in str(out[0])


def test_frames_over_the_bounds_or_not_json_are_refused():
    # Before the token: the connection is closed, and the error the update ends with says why.
    for frames, why in (
            ([broadcast._HEADER.pack(b"PDWB", broadcast._BUCKET, 0, broadcast.MAX_BUCKET_BYTES + 1)], "not a HELLO"),
            ([broadcast._HEADER.pack(b"PDWB", broadcast._HELLO, broadcast.MAX_HELLO_BYTES + 1, 0)], "not a HELLO"),
            ([broadcast._HEADER.pack(b"HTTP", 1, 0, 0)], "not a HELLO"),
            ([broadcast._HEADER.pack(b"PDWB", broadcast._HELLO, 5, 0) + b"{nope"], "not JSON")):
        receiver = WeightReceiver(name="r", timeout=2)
        meta = receiver.prepare()
        thread, out = receive_in_thread(receiver)
        sock = _raw_peer(meta, frames)
        thread.join(10)
        sock.close()
        assert isinstance(out[0], UnavailableError) and why in str(out[0]), out
    # After it: the update fails with a DataLossError.
    receiver = WeightReceiver(name="r", timeout=10)
    meta = receiver.prepare()
    thread, out = receive_in_thread(receiver)
    sock = _raw_peer(meta, [_hello(meta), broadcast._HEADER.pack(b"PDWB", broadcast._BUCKET, 0,
                                                                 broadcast.MAX_BUCKET_BYTES + 1)])
    thread.join(10)
    sock.close()
    assert isinstance(out[0], DataLossError) and "over the bounds" in str(out[0]), out


def test_an_end_frame_that_miscounts_is_refused():
    receiver = WeightReceiver(name="r", timeout=10)
    meta = receiver.prepare()
    thread, out = receive_in_thread(receiver)
    sock = _raw_peer(meta, [_hello(meta), broadcast._frame_head(broadcast._END, {"tensors": 3, "bytes": 12})])
    thread.join(10)
    sock.close()
    assert isinstance(out[0], DataLossError) and "announced 3 tensors" in str(out[0])


def test_a_stalled_upstream_and_an_absent_one_meet_the_deadline():
    receiver = WeightReceiver(name="r", timeout=0.5)
    meta = receiver.prepare()
    thread, out = receive_in_thread(receiver)
    sock = _raw_peer(meta, [_hello(meta)])  # then nothing
    thread.join(10)
    sock.close()
    assert isinstance(out[0], UnavailableError) and "timed out" in str(out[0])
    receiver.prepare()
    thread, out = receive_in_thread(receiver)  # nobody connects
    thread.join(10)
    assert isinstance(out[0], UnavailableError) and "no upstream connected" in str(out[0])


def test_a_dead_downstream_is_recorded_while_the_replica_keeps_its_copy():
    first, second = WeightReceiver(name="first", timeout=10), WeightReceiver(name="second", timeout=10)
    head, downs = build_topology([first.prepare(), second.prepare()])
    # The second replica's listener takes the connection and closes it at once.
    second._listener.settimeout(10)
    closer = threading.Thread(target=lambda: second._listener.accept()[0].close())
    closer.start()
    thread, out = receive_in_thread(first, downs[0])
    big = {"w": torch.randn(8 << 20)}  # 32 MiB: more than the socket buffers take
    WeightSender(bucket_bytes=1 << 20, timeout=10).send(big.items(), head)
    thread.join(30)
    closer.join(10)
    assert torch.equal(dict(out[0])["w"], big["w"])
    assert first.downstream_error and first.downstream_error.startswith("replica second at ")


def test_arguments_are_checked():
    with pytest.raises(InvalidArgumentError, match="bucket_bytes"):
        WeightSender(bucket_bytes=10)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        WeightReceiver(timeout=0)
    with pytest.raises(InvalidArgumentError, match="before prepare"):
        WeightReceiver().receive()
    with pytest.raises(InvalidArgumentError, match="one metadata dict"):
        build_topology([])
    receiver = WeightReceiver(timeout=10)
    meta = receiver.prepare()
    thread, out = receive_in_thread(receiver)
    with pytest.raises(InvalidArgumentError, match="pairs"):
        WeightSender().send([("w", [1.0])], meta)
    thread.join(15)
    assert isinstance(out[0], UnavailableError)
    assert json.loads(json.dumps(meta))["port"] == meta["port"]  # metadata is plain JSON


def test_verl_shaped_async_send_weights_and_receive_weights():
    import asyncio

    async def update() -> list:
        receiver = WeightReceiver(name="r", timeout=10)
        head, _ = build_topology([receiver.prepare()])

        async def take() -> list:
            return [pair async for pair in receiver.receive_weights(global_steps=4)]

        got, sent = await asyncio.gather(take(), WeightSender(timeout=10).send_weights(
            iter(_state().items()), head, global_steps=4))
        assert sent["tensors"] == len(got)
        return got

    got = asyncio.run(update())
    assert [name for name, _ in got] == list(_state())
    assert all(torch.equal(t, _state()[n]) for n, t in got)
