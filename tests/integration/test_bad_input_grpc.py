"""Bad input on every gRPC service (Scheduler, NodeAgent, Worker), from an authenticated peer.

Garbage bytes, truncated messages, hypothesis-generated requests of every type and
unknown methods each get a clear status (never UNKNOWN or INTERNAL, which would mean a
handler crashed on them), and every service keeps serving real requests afterwards.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.live_services import SERVICES, LiveServices, method_paths, raw_call
from tests.support.proto_strategies import filled, messages
from google.protobuf.message_factory import GetMessageClass

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

#: Statuses that mean a handler failed on its input instead of judging it.
CRASHED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
#: Short, so a request that makes a service wait (a Wait* with a long timeout, a followed
#: log) ends quickly; DEADLINE_EXCEEDED then is the client's doing, not a failure.
CALL_TIMEOUT = 3.0

ALL_METHODS = [(service, path, method) for service in SERVICES for path, method in method_paths(service)]
#: Worker.Shutdown with a parsable request would stop the host the other cases need.
SURVIVABLE = [m for m in ALL_METHODS if m[1] != "/podium.v1.Worker/Shutdown"]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    import secrets

    with LiveServices(secrets.token_urlsafe(16), tmp_path_factory.mktemp("live")) as services:
        yield services


def _judged(error: grpc.RpcError | None, what: str) -> None:
    """The call either worked or failed with a deliberate, described status."""
    if error is None:
        return
    assert error.code() not in CRASHED, f"{what}: {error.code()} {error.details()}"
    assert error.details(), f"{what}: {error.code()} without a message"


@pytest.mark.parametrize("payload", [b"\xff\xfe\xfd garbage \x00\x01\x02", b"\x0a\xff\xff\xff\xff\x0f",
                                     b"\x08" * 9, b"\x12\x05ab"], ids=["garbage", "bad-length", "varint", "short"])
def test_garbage_bytes_are_invalid_argument_naming_the_message(live, payload):
    for service, path, method in ALL_METHODS:
        with live.channel(service) as channel:
            error = raw_call(channel, path, method, payload, live.metadata(), timeout=CALL_TIMEOUT)
        assert error is not None, path
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (path, error.code(), error.details())
        assert f"malformed {method.input_type.full_name}" in error.details()
    live.assert_serving()


def test_truncated_requests_get_a_clear_answer(live):
    for service, path, method in SURVIVABLE:
        whole = filled(GetMessageClass(method.input_type)).SerializeToString()
        cuts = sorted({1, len(whole) // 3, len(whole) // 2, len(whole) - 1} - {0, len(whole)})
        with live.channel(service) as channel:
            for cut in cuts:
                error = raw_call(channel, path, method, whole[:cut], live.metadata(), timeout=CALL_TIMEOUT)
                _judged(error, f"{path} cut at {cut}/{len(whole)}")
    live.assert_serving()


def test_unknown_methods_and_services_are_unimplemented(live):
    from tests.support.live_services import raw_call as call

    class _Unary:  # shape of a MethodDescriptor for raw_call
        client_streaming = server_streaming = False

    for service in SERVICES:
        with live.channel(service) as channel:
            for path in (f"/{service}/NoSuchMethod", "/podium.v1.Nope/Call", f"/{service}/describe", "/"):
                error = call(channel, path, _Unary, b"", live.metadata(), timeout=CALL_TIMEOUT)
                assert error is not None and error.code() is grpc.StatusCode.UNIMPLEMENTED, (path, error)
            # Without the token an unknown method is just as unauthenticated (nothing to probe).
            error = call(channel, f"/{service}/NoSuchMethod", _Unary, b"", live.metadata(None),
                         timeout=CALL_TIMEOUT)
            assert error.code() is grpc.StatusCode.UNAUTHENTICATED
    live.assert_serving()


@pytest.mark.parametrize("service,path,method", SURVIVABLE, ids=[m[1].split("/", 1)[1] for m in SURVIVABLE])
def test_generated_requests_never_crash_a_handler(live, service, path, method):
    cls = GetMessageClass(method.input_type)
    channel = live.channel(service)

    @settings(max_examples=25, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request=messages(cls))
    def check(request):
        error = raw_call(channel, path, method, request.SerializeToString(), live.metadata(),
                         timeout=CALL_TIMEOUT)
        _judged(error, f"{path} with {request}")

    try:
        check()
    finally:
        channel.close()
    live.assert_serving()


def test_a_worker_shutdown_request_that_does_not_parse_stops_nothing(live):
    service, path, method = next(m for m in ALL_METHODS if m[1] == "/podium.v1.Worker/Shutdown")
    with live.channel(service) as channel:
        for payload in (b"\x0a\x10short", b"\xff"):
            error = raw_call(channel, path, method, payload, live.metadata(), timeout=CALL_TIMEOUT)
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    live.assert_serving()


def test_messages_above_the_grpc_maximum_are_refused(live):
    from podium.rpc import MAX_MESSAGE_BYTES

    huge = b"\x0a" + b"\xff" * 4 + b"\x7f" + b"x" * (MAX_MESSAGE_BYTES + 1024)
    for service, path, method in [next(m for m in ALL_METHODS if m[0] == s) for s in SERVICES]:
        with live.channel(service) as channel:
            error = raw_call(channel, path, method, huge, live.metadata(), timeout=30)
        assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, (path, error)
    live.assert_serving()


def test_a_call_announcing_more_than_the_maximum_payload_is_refused_at_once(live):
    from podium import rpc
    from podium.v1 import worker_pb2

    header = worker_pb2.CallHeader(kind=worker_pb2.CALL, method="add", payload_size=1 << 62)
    frame = worker_pb2.CallFrame(call_id=9, header=header, data=b"x" * 10, last=False)
    with live.channel("podium.v1.Worker") as channel:
        stream = channel.stream_stream("/podium.v1.Worker/Calls", response_deserializer=worker_pb2.ReplyFrame.FromString)
        replies = list(stream(iter([frame.SerializeToString()]), metadata=live.metadata(), timeout=10))
    assert len(replies) == 1 and replies[0].call_id == 9 and not replies[0].header.ok
    error = rpc.error_from_info(replies[0].header.error)
    assert type(error).__name__ == "PayloadTooLargeError" and "exceeds the maximum" in str(error)
    live.assert_serving()
