"""The three public facades: each name has one home, each ``__all__`` is sorted and pinned.

A facade that gains or loses a name fails here on purpose: change the list below in the
same commit, and say why in its message.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from tests.support.waiting import REPO


FACADES = {
    "podium": [
        "AbortedError", "ActorUnavailableError", "AlreadyExistsError", "ArgumentMismatchError", "AuthenticationError",
        "CancelledError", "DataLossError", "DataProto", "DataProtoConfig", "DataProtoFuture",
        "DataProtoItem", "DeadlineExceededError", "FailedPreconditionError", "InfeasibleError",
        "InternalError", "InvalidArgumentAssertion", "InvalidArgumentError", "InvalidSpecError", "NotFoundError",
        "NotProvidedError", "ObjectLostError", "ObjectRef",
        "OutOfRangeError", "OwnerDiedError", "PayloadTooLargeError", "PermissionDeniedError", "PodiumError",
        "RankZeroDispatchError", "RemoteError", "ResourceExhaustedError", "SlotFullError", "TlsConfig",
        "UnavailableError", "UnimplementedError", "UnknownMethodError", "UnresponsiveError",
        "WeightBroadcastError", "WorkerDiedError", "__version__", "call_timeout", "get", "get_actor", "init", "is_initialized",
        "kill", "put", "remote", "shutdown", "stacks", "timeline", "wait",
    ],
    "podium.controller": [
        "ClassWithInitArgs", "NodeAffinitySchedulingStrategy", "PlacementGroupSchedulingStrategy",
        "RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "ResourcePool",
        "ResourcePoolManager", "SubRayResourcePool", "WorkerGroup", "WorkerHandle",
        "create_colocated_worker_cls", "create_colocated_worker_cls_fused", "create_colocated_worker_raw_cls",
        "make_nd_compute_dataproto_dispatch_fn", "merge_resource_pool", "register_dispatch_mode",
        "split_resource_pool", "update_dispatch_mode",
    ],
    "podium.worker": ["Dispatch", "DynamicEnum", "Execute", "Rendezvous", "Worker", "WorkerHelper", "on_rendezvous",
                      "register"],
}


@pytest.mark.parametrize("name", sorted(FACADES))
def test_exports_are_pinned_and_sorted(name):
    module = importlib.import_module(name)
    assert list(module.__all__) == sorted(module.__all__), f"{name}.__all__ is not sorted"
    assert list(module.__all__) == FACADES[name]
    for export in module.__all__:
        value = getattr(module, export)
        if export != "__version__":
            assert getattr(value, "__doc__", None), f"{name}.{export} has no docstring"


def documented_facades() -> dict[str, set[str]]:
    """facade -> the names its bullet in docs/architecture.md lists."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("One public facade per audience"):text.index("Every error a user can see")]
    bullets = re.split(r"^- ", section, flags=re.M)[1:]
    found = {}
    for bullet in bullets:
        head, _, rest = bullet.partition(":")
        found[head.strip("`")] = set(re.findall(r"`(\w+)`", rest))
    return found


def test_the_docs_list_each_facade_as_it_is():
    documented = documented_facades()
    assert set(documented) == set(FACADES)
    for facade, names in FACADES.items():
        module = importlib.import_module(facade)
        errors = {n for n in names if isinstance(getattr(module, n), type)
                  and issubclass(getattr(module, n), BaseException)}
        assert documented[facade] == set(names) - errors, facade
        if errors:  # the errors are named as "every error class"
            assert facade == "podium"


def test_no_name_has_two_homes():
    seen: dict[str, str] = {}
    for facade, names in FACADES.items():
        for export in names:
            assert export not in seen, f"{export} is exported by both {seen[export]} and {facade}"
            seen[export] = facade


def test_every_public_exception_is_in_the_one_tree():
    # Every exception class defined in a Podium module derives from PodiumError and is
    # exported by the top-level facade.
    import podium
    for mod_name in ("podium.errors", "podium.controller.dispatch.modes", "podium.controller.group",
                     "podium.controller.remote.actors", "podium.controller.remote.objects", "podium.controller.remote.tasks",
                     "podium.worker.decorator", "podium.dataproto", "podium.refs", "podium.compat.ray"):
        module = importlib.import_module(mod_name)
        for attr in dir(module):
            value = getattr(module, attr)
            if (isinstance(value, type) and issubclass(value, BaseException) and value.__module__.startswith("podium")
                    and not attr.startswith("_")):
                assert issubclass(value, podium.errors.PodiumError), f"{mod_name}.{attr} is outside the tree"
                assert attr in podium.__all__, f"{attr} is not exported by podium"


def test_import_podium_stays_light():
    # The node agent imports podium; it must never pay for torch (or gRPC) to do so.
    code = "import podium, sys; bad = [m for m in ('torch', 'grpc') if m in sys.modules]; assert not bad, bad"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


#: Builtin exceptions still raised in product code, each for a reason: internal invariants a
#: user cannot reach (the caller sized the buffer, the transport built the segment, the fork
#: server speaks to its own agent), a mapping's KeyError, and Ray's own error for ray.init twice.
BUILTIN_RAISES_ALLOWED = {
    ("podium/memorypool.py", "ValueError"), ("podium/transport/shmpool.py", "ValueError"),
    ("podium/transport/chunks.py", "ValueError"), ("worker/agent/forkhelper.py", "ValueError"),
    ("scheduler/core/views.py", "KeyError"), ("podium/compat/ray.py", "RuntimeError"),
}
BUILTINS = {"ValueError", "TypeError", "AssertionError", "RuntimeError", "KeyError", "Exception"}


def test_product_code_raises_podium_errors_not_bare_builtins():
    import ast

    found = set()
    for folder in ("podium", "controller", "worker", "scheduler"):
        for path in (REPO / folder).rglob("*.py"):
            rel = str(path.relative_to(REPO))
            if rel.startswith("podium/v1/"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                exc = node.exc if isinstance(node, ast.Raise) else None
                if isinstance(exc, ast.Call):
                    exc = exc.func
                if isinstance(exc, ast.Name) and exc.id in BUILTINS:
                    found.add((rel, exc.id))
    assert found <= BUILTIN_RAISES_ALLOWED, sorted(found - BUILTIN_RAISES_ALLOWED)
