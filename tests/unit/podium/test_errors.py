"""The exception tree and its mapping to gRPC status codes."""

import pickle

import grpc
import pytest

from podium import errors, rpc


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK],
                         ids=lambda c: c.name)
def test_every_status_code_round_trips(code):
    # code -> class -> code is the identity for every non-OK status.
    cls = errors.CLASS_OF_STATUS[code.name]
    exc = cls(f"a {code.name} happened")
    assert rpc.status_code_of(exc) is code
    info = rpc.error_info_of(exc)
    back = rpc.error_from_info(info, code.name)
    assert type(back) is cls and back.message == exc.message


@pytest.mark.parametrize("exc, builtin", [
    (errors.InvalidSpecError("bad"), ValueError),
    (errors.DeadlineExceededError("slow"), TimeoutError),
    (errors.NotFoundError("who"), LookupError),
    (errors.WorkerDiedError("dead"), ConnectionError),
    (errors.UnknownMethodError("nope"), AttributeError),
    (errors.NotProvidedError("ray.data"), AttributeError),
    (errors.NotProvidedError("ray.data"), NotImplementedError),
    (errors.AuthenticationError("token"), PermissionError),
])
def test_builtin_mixins(exc, builtin):
    assert isinstance(exc, builtin) and isinstance(exc, errors.PodiumError)


@pytest.mark.parametrize("exc", [
    errors.InfeasibleError("cannot place", node_reasons={"node-b": "4 GPUs, bundle group needs 8"}),
    errors.WorkerDiedError("rank 3 died", signal=9, stderr_tail="oom", rank=3, node="n1"),
    errors.RemoteError("boom", traceback="Traceback ...", remote_type="builtins.ValueError", rank=1),
    errors.SlotFullError("bundle 0 full"),
])
def test_subclasses_survive_the_wire_and_pickle(exc):
    # Subclasses travel as their base code plus ErrorInfo.type, so the exact class comes back.
    back = rpc.error_from_info(rpc.error_info_of(exc), errors.status_name_of(exc))
    # A RemoteError comes back as also its raised type where that class is here (see below).
    expected = errors.remote_error_class(exc.remote_type) if type(exc) is errors.RemoteError else type(exc)
    for copy in (back, pickle.loads(pickle.dumps(exc))):
        assert type(copy) is expected
        assert str(copy) == str(exc)
        assert copy.rank == exc.rank and copy.details == exc.details


def test_messages_say_what_to_act_on():
    died = errors.WorkerDiedError("worker rank 2 on node-a died", signal=9, stderr_tail="last words")
    assert "SIGKILL" in str(died) and "last words" in str(died) and died.signal == 9
    infeasible = errors.InfeasibleError("no node can hold it", node_reasons={"node-b": "4 GPUs"})
    assert "node-b: 4 GPUs" in str(infeasible)
    remote = errors.RemoteError("x", traceback="TB", remote_type="builtins.KeyError", rank=0)
    assert "builtins.KeyError in rank 0" in str(remote) and "TB" in str(remote)


def test_foreign_exception_becomes_remote_error():
    fields = errors.error_fields(KeyError("k"))
    exc = errors.error_from_fields(**{k: v for k, v in fields.items() if k != "type"}, type_name=fields["type"])
    assert isinstance(exc, errors.RemoteError) and exc.remote_type == "builtins.KeyError"


class _NotImportedHere(Exception):
    pass


@pytest.mark.parametrize("remote_type, also", [
    ("ValueError", ValueError),  # a worker names builtins unqualified
    ("builtins.KeyError", KeyError),
    (f"{__name__}._NotImportedHere", _NotImportedHere),
])
def test_a_remote_error_is_also_its_raised_type_when_that_class_is_here(remote_type, also):
    exc = errors.error_from_fields("RemoteError", "boom", details={"remote_type": remote_type})
    assert isinstance(exc, errors.RemoteError) and isinstance(exc, also)
    again = pickle.loads(pickle.dumps(exc))
    assert isinstance(again, also) and again.remote_type == remote_type and "boom" in str(again)


@pytest.mark.parametrize("remote_type", ["nosuchmodule.Error", "builtins.SystemExit", "StopIteration",
                                         "podium.errors.UnavailableError", "os.path", ""])
def test_a_remote_type_not_here_or_not_an_exception_stays_a_plain_remote_error(remote_type):
    exc = errors.error_from_fields("RemoteError", "boom", details={"remote_type": remote_type})
    assert type(exc) is errors.RemoteError
