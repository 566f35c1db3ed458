"""Bad input on every gRPC service (Scheduler, NodeAgent, Worker), from an authenticated peer.

Garbage bytes, truncated messages, hypothesis-generated requests of every type and
unknown methods each get a clear status (never UNKNOWN or INTERNAL, which would mean a
handler crashed on them), and every service keeps serving real requests afterwards.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings

from podium import rpc
from tests.support.live_services import SERVICES, method_paths, raw_call
from tests.support.proto_strategies import filled, messages

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

#: Statuses that mean a handler failed on its input instead of judging it.
CRASHED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
#: Short, so a request that makes a service wait (a Wait* with a long timeout, a followed
#: log) ends quickly; DEADLINE_EXCEEDED then is the client's doing, not a failure.
CALL_TIMEOUT = 3.0

ALL_METHODS = [(service, path, method) for service in SERVICES for path, method in method_paths(service)]
#: Worker.Shutdown with a parsable request would stop the host the other cases need.
SURVIVABLE = [m for m in ALL_METHODS if m[1] != "/podium.v1.Worker/Shutdown"]


#: What a handler answers a request it judged bad, or one that cannot be served now.
DELIBERATE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.ABORTED,
              grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


def _judged(error: grpc.RpcError | None, what: str) -> None:
    """A well-formed request is served, or refused on purpose: a deliberate status that
    carries Podium's ErrorInfo (a handler raised a PodiumError naming the problem).
    DEADLINE_EXCEEDED is this test's own short client deadline on a request that waits."""
    if error is None or error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return
    code = error.code()
    assert code not in CRASHED, f"{what}: {code} {error.details()}"
    assert code in DELIBERATE, f"{what}: unexpected {code} {error.details()}"
    assert error.details(), f"{what}: {code} without a message"
    keys = [key for key, _ in (error.trailing_metadata() or ())]
    assert rpc.ERROR_METADATA_KEY in keys, f"{what}: {code} without Podium's ErrorInfo ({error.details()})"


def _parses(cls, data: bytes) -> bool:
    try:
        cls.FromString(data)
    except DecodeError:
        return False
    return True


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
    # A cut inside a field does not parse: INVALID_ARGUMENT naming the message type. A cut
    # at a field boundary is a valid, shorter request: judged like any other.
    malformed = 0
    for service, path, method in SURVIVABLE:
        cls = GetMessageClass(method.input_type)
        whole = filled(cls).SerializeToString()
        cuts = sorted({1, len(whole) // 3, len(whole) // 2, len(whole) - 1} - {0, len(whole)})
        with live.channel(service) as channel:
            for cut in cuts:
                what = f"{path} cut at {cut}/{len(whole)}"
                error = raw_call(channel, path, method, whole[:cut], live.metadata(), timeout=CALL_TIMEOUT)
                if _parses(cls, whole[:cut]):
                    _judged(error, what)
                    continue
                malformed += 1
                assert error is not None, f"{what}: a request that does not parse was served"
                assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (what, error.code(), error.details())
                assert f"malformed {method.input_type.full_name}" in error.details(), what
    assert malformed, "no cut fell inside a field: the test checked nothing about malformed input"
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
