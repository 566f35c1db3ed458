"""The cluster token on every gRPC method of every service, the health service included.

A call without the token, or with a wrong one, is UNAUTHENTICATED before its request
is parsed: the handler never runs, nothing changes, and (the point of it all) a pickled
payload from such a peer is never unpickled, on the gRPC port and on the worker's raw
call socket (podium.transport.callsocket) alike. The comparison is constant-time
(hmac.compare_digest, see podium.auth.token_matches).
"""

from __future__ import annotations


import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2

from tests.support.live_services import SERVICES, method_paths, raw_call
from podium import codec, rpc
from podium.auth import TOKEN_METADATA_KEY, token_matches
from podium.v1 import worker_pb2
from tests.support.proto_strategies import filled
from tests.support.waiting import eventually

pytestmark = pytest.mark.faults

HEALTH = [("/grpc.health.v1.Health/Check", False), ("/grpc.health.v1.Health/Watch", True)]


class _Shape:
    """The streaming shape raw_call needs, for methods outside podium.v1."""

    def __init__(self, server_streaming: bool) -> None:
        self.client_streaming = False
        self.server_streaming = server_streaming


def _bad_credentials(live) -> dict[str, tuple]:
    token = live.token
    return {
        "none": (),
        "wrong": rpc.token_metadata(token[:-1] + ("A" if token[-1] != "A" else "B")),
        "prefix": rpc.token_metadata(token[:8]),
        "longer": rpc.token_metadata(token + "x"),
        "no-bearer": ((TOKEN_METADATA_KEY, token),),
        "other-key": (("x-podium-token", f"Bearer {token}"),),
        "empty": rpc.token_metadata(""),
    }


def _state(live):
    """What an accepted call could have changed, to compare before and after."""
    async def snapshot():
        sched = live.scheduler.service.model
        return (sorted(sched.nodes), sorted(sched.groups), sorted(sched.workers),
                len(live.agent.spawner.workers()), live.host.runtime.stats_now()["calls"],
                live.host.runtime.stopping.is_set())
    return live.run(snapshot())


def test_every_method_refuses_a_missing_or_wrong_token(live):
    before = _state(live)
    for label, metadata in _bad_credentials(live).items():
        for service in SERVICES:
            with live.channel(service) as channel:
                calls = [(path, m, filled(GetMessageClass(m.input_type)).SerializeToString())
                         for path, m in method_paths(service)]
                calls += [(path, _Shape(streaming), health_pb2.HealthCheckRequest().SerializeToString())
                          for path, streaming in HEALTH]
                for path, method, payload in calls:
                    error = raw_call(channel, path, method, payload, metadata, timeout=10)
                    assert error is not None, f"{path} accepted credentials {label!r}"
                    assert error.code() is grpc.StatusCode.UNAUTHENTICATED, (path, label, error)
                    assert "token" in error.details()
    # Nothing ran: no node, group, worker, process, call or shutdown came of it.
    assert _state(live) == before
    live.assert_serving()


def test_a_payload_from_an_unauthenticated_peer_is_never_unpickled(live, tmp_path):
    class Trap:
        """Unpickling this creates a file: the proof that bytes were decoded."""

        def __init__(self, path):
            self.path = path

        def __reduce__(self):
            return open, (self.path, "w")

    def frames(path, kind, method=""):
        payload = b"".join(codec.encode(((Trap(str(path)),), {})).to_segments())
        header = worker_pb2.CallHeader(kind=kind, method=method, payload_size=len(payload))
        return [worker_pb2.CallFrame(call_id=1, header=header, data=payload, last=True).SerializeToString()]

    calls_path = "/podium.v1.Worker/Calls"
    with live.channel("podium.v1.Worker") as channel:
        stream = channel.stream_stream(calls_path)
        for label, metadata in _bad_credentials(live).items():
            for kind, method in ((worker_pb2.CALL, "touch"), (worker_pb2.CONSTRUCT, "")):
                trap = tmp_path / f"trap-{label}-{kind}"
                with pytest.raises(grpc.RpcError) as info:
                    list(stream(iter(frames(trap, kind, method)), metadata=metadata, timeout=10))
                assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert not trap.exists(), f"credentials {label!r}: the payload was unpickled"
        # The same bytes with the token are decoded (the trap is live, so the test proves something).
        trap = tmp_path / "trap-with-token"
        replies = list(stream(iter(frames(trap, worker_pb2.CALL, "touch")), metadata=live.metadata(), timeout=10))
        assert trap.exists() and replies
    live.assert_serving()


def test_token_comparison_is_constant_time_and_exact():
    import inspect

    assert "compare_digest" in inspect.getsource(token_matches)
    assert token_matches("abc", "abc")
    for presented in (None, "", "ab", "abcd", "ABC", "abc "):
        assert not token_matches("abc", presented)


def test_agent_metrics_endpoint_needs_the_token(live):
    import asyncio

    import aiohttp

    url = f"http://{live.agent.host}:{live.agent.metrics.port}"

    async def probe():
        async with aiohttp.ClientSession() as http:
            out = {}
            for label, headers in (("none", {}), ("wrong", {"Authorization": f"Bearer {live.token}x"}),
                                   ("raw", {"Authorization": live.token}),
                                   ("good", {"Authorization": f"Bearer {live.token}"})):
                async with http.get(url + "/metrics", headers=headers) as resp:
                    out[label] = (resp.status, await resp.text())
            async with http.post(url + "/metrics", headers={"Authorization": f"Bearer {live.token}"},
                                 data=b"x") as resp:
                out["post"] = (resp.status, "")
            return out
    out = asyncio.run(probe())
    assert {k: v[0] for k, v in out.items()} == {"none": 401, "wrong": 401, "raw": 401, "good": 200, "post": 405}
    assert all(live.token not in text for _, text in out.values())


def _trap_frame(path, kind=None, method="touch") -> bytes:
    class Trap:
        def __init__(self, path):
            self.path = path

        def __reduce__(self):
            return open, (self.path, "w")

    payload = b"".join(codec.encode(((Trap(str(path)),), {})).to_segments())
    header = worker_pb2.CallHeader(kind=kind or worker_pb2.CALL, method=method, payload_size=len(payload))
    return worker_pb2.CallFrame(call_id=1, header=header, data=payload, last=True).SerializeToString()


def _raw_socket_exchange(port: int, token: bytes, frames: list[bytes], magic: bytes = b"PDMC") -> bytes:
    """Speak podium.transport.callsocket by hand: hello with ``token``, then frames; everything read back."""
    import socket
    import struct

    from podium.transport import callsocket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(struct.pack("<4sBH", magic, callsocket.VERSION, len(token)) + token
                     + b"".join(struct.pack("<I", len(f)) + f for f in frames))
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            received += chunk
        return received


def test_the_raw_call_socket_never_unpickles_for_a_wrong_token(live, tmp_path):
    port = live.host.runtime.call_port
    assert port, "the worker host serves no raw call socket (is PODIUM_RAW_CALLS=0 set?)"
    token = live.token.encode()
    for label, offered in (("none", b""), ("wrong", token[:-1] + b"?"), ("prefix", token[:8]),
                           ("longer", token + b"x"), ("bearer", b"Bearer " + token)):
        trap = tmp_path / f"raw-trap-{label}"
        reply = _raw_socket_exchange(port, offered, [_trap_frame(trap)])
        assert reply[:1] in (b"\x01", b""), (label, reply[:20])  # rejected (or closed)
        assert not trap.exists(), f"raw socket, token {label!r}: the payload was unpickled"
    # Not the protocol at all: closed, nothing decoded.
    trap = tmp_path / "raw-trap-magic"
    assert _raw_socket_exchange(port, token, [_trap_frame(trap)], magic=b"GET ")[:1] != b"\x00"
    assert not trap.exists()
    # The right token: accepted and decoded (the trap is live).
    trap = tmp_path / "raw-trap-good"
    assert _raw_socket_exchange(port, token, [_trap_frame(trap)])[:1] == b"\x00"
    eventually(trap.exists, "the accepted payload to be unpickled (the trap file)", 10)
    live.assert_serving()
