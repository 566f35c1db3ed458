"""Bad calls to a worker: unknown methods, wrong argument counts, unpicklable arguments,
payloads above the configured maximum. Each is a clear error; the worker serves on."""

from __future__ import annotations

import threading

import pytest

from podium import errors

pytestmark = pytest.mark.faults

MAX_PAYLOAD = 256 * 1024


LIVE_WORKER_ENV = {"PODIUM_MAX_PAYLOAD_BYTES": str(MAX_PAYLOAD)}


def _calls(live) -> int:
    return live.run(live.client.describe()).stats["calls"]


@pytest.mark.parametrize("method, args, kwargs, error, text", [
    ("nope", (), {}, errors.UnknownMethodError, "has no method 'nope'"),
    ("ad", (1, 2), {}, errors.UnknownMethodError, "did you mean add"),
    ("add", (1,), {}, errors.ArgumentMismatchError, "Target.add(a, b): missing a required argument: 'b'"),
    ("add", (1, 2, 3), {}, errors.ArgumentMismatchError, "too many positional arguments"),
    ("add", (1, 2), {"c": 3}, errors.ArgumentMismatchError, "unexpected keyword argument 'c'"),
    ("add", (), {"a": 1, "b": 2, "a2": 0}, errors.ArgumentMismatchError, "'a2'"),
])
def test_unknown_methods_and_wrong_arguments(live, method, args, kwargs, error, text):
    with pytest.raises(error) as info:
        live.run(live.client.call(method, args, kwargs), timeout=30)
    assert text in str(info.value) and info.value.rank == 0
    if error is errors.ArgumentMismatchError:
        assert isinstance(info.value, TypeError)  # what Ray raises for the same mistake
    live.assert_serving()


@pytest.mark.parametrize("value, kind", [(threading.Lock(), "lock"), ((i for i in ()), "generator")])
def test_unpicklable_arguments_fail_before_anything_is_sent(live, value, kind):
    calls = _calls(live)
    with pytest.raises(errors.InvalidArgumentError) as info:
        live.run(live.client.call("add", (1, value)), timeout=30)
    assert f"at [0][1] (a {kind})" in str(info.value)
    assert _calls(live) == calls  # the worker never saw it
    live.assert_serving()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_payload_above_the_maximum_is_refused(live, transport):
    client = live.client
    same_host, threshold = client.same_host, client.shm_threshold
    client.same_host = transport == "shm"
    client.shm_threshold = 64 * 1024  # both payloads below go through /dev/shm then
    try:
        with pytest.raises(errors.PayloadTooLargeError) as info:
            live.run(client.call("add", (b"x" * (2 * MAX_PAYLOAD), b"")), timeout=60)
        assert f"maximum of {MAX_PAYLOAD} bytes" in str(info.value)
        # Just below the limit still works on the same stream.
        assert len(live.run(client.call("add", (b"x" * (MAX_PAYLOAD // 2), b"")), timeout=60)) == MAX_PAYLOAD // 2
    finally:
        client.same_host, client.shm_threshold = same_host, threshold
    live.assert_serving()
