"""Native verl mode (``podium run --native-verl``): ``verl.single_controller.ray`` is Podium's
own controller SDK instead of verl's Ray classes.

In Ray mode (the default) verl's ``RayWorkerGroup`` runs unchanged on the ``ray`` stand-in's
actors: every call is an actor call, its arguments pickled. In native mode the import of
``verl.single_controller.ray`` (and of its ``base`` module) yields a module whose names are
:mod:`podium.controller`'s (``RayWorkerGroup``, ``RayResourcePool``, ``RayClassWithInitArgs``,
``ResourcePoolManager``, ``create_colocated_worker_cls``...), so a verl trainer's groups are
Podium worker groups: one fan-out per call, tensors and ``DataProto``\\s as raw buffers.
verl's ``Worker`` subclasses, its ``@register`` and its ``DataProto`` are used as they are.

The stand-in's ``ray`` package installs the finder when ``PODIUM_NATIVE_VERL=1`` is in the
environment (``podium run --native-verl`` and ``podium.compat.activate(native_verl=True)`` set
it, and workers inherit it). That is early enough: ``import verl`` imports ``verl.protocol``,
which imports ``ray``, before anything can import ``verl.single_controller.ray``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

from podium.errors import UnimplementedError

__all__ = ["NATIVE_ENV", "NATIVE_NAMES", "install", "installed", "verl_future", "verl_future_class", "wanted"]

#: The environment variable that selects native mode ("1").
NATIVE_ENV = "PODIUM_NATIVE_VERL"

#: The modules native mode replaces.
PACKAGE = "verl.single_controller.ray"
BASE = PACKAGE + ".base"

#: What ``verl.single_controller.ray`` (and ``.base``) export in native mode: every name of
#: verl 0.9.1's ``verl/single_controller/ray/__init__.py`` and the ones verl imports from ``.base``.
NATIVE_NAMES = (
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolManager",
    "SubRayResourcePool",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "merge_resource_pool",
    "split_resource_pool",
)


def wanted(env: dict[str, str] | None = None) -> bool:
    """Whether native mode is asked for in ``env`` (default: this process's)."""
    return (os.environ if env is None else env).get(NATIVE_ENV, "") == "1"


class _NativeModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and fills the two replaced modules (first on ``sys.meta_path``)."""

    def find_spec(self, fullname, path=None, target=None):
        """A spec for the replaced modules; None for every other import."""
        if fullname not in (PACKAGE, BASE):
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == PACKAGE)
        if fullname == PACKAGE:
            spec.submodule_search_locations = []  # only ``.base``, which this finder serves
        return spec

    def create_module(self, spec):
        """The default module object."""
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        """Fill ``module`` with Podium's controller names."""
        import podium.controller as sdk

        def missing(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            raise UnimplementedError(
                f"{module.__name__}.{name} is not provided in native verl mode (podium run --native-verl): "
                f"it has {', '.join(NATIVE_NAMES)}; run without --native-verl to use verl's own module")

        names = vars(module)
        names.update({name: getattr(sdk, name) for name in NATIVE_NAMES})
        names.update(__all__=list(NATIVE_NAMES), __podium__=True, __getattr__=missing,
                     __doc__=f"Podium's controller SDK as verl's {module.__name__} (podium run --native-verl); "
                             "see podium.compat.nativeverl.")
        if module.__name__ == PACKAGE:
            names["base"] = importlib.import_module(BASE)


_FINDER = _NativeModules()


def installed() -> bool:
    """Whether this process imports ``verl.single_controller.ray`` as Podium's SDK."""
    return _FINDER in sys.meta_path


def install() -> None:
    """Make ``verl.single_controller.ray`` Podium's SDK in this process (before its first
    import; a verl module already imported stays what it is, and a PodiumError says so)."""
    from podium.errors import FailedPreconditionError

    loaded = sys.modules.get(PACKAGE)
    if loaded is not None and not getattr(loaded, "__podium__", False):
        raise FailedPreconditionError(f"{PACKAGE} is already imported from verl: native verl mode must be "
                                      "installed before it (podium run --native-verl does this)")
    if not installed():
        sys.meta_path.insert(0, _FINDER)
        from podium.controller.dispatch import data as dispatchdata

        dispatchdata.future_factory = verl_future  # blocking=False concat calls give verl's future type


@functools.cache
def verl_future_class() -> type:
    """The type of a ``blocking=False`` concat-mode call's result in native mode: Podium's
    :class:`~podium.controller.session.futures.PendingDataProtoFuture` that is also verl's
    ``verl.protocol.DataProtoFuture`` (verl code and tests check ``isinstance`` against
    verl's class). Podium's methods (``get``, ``chunk``, lazy resolution) are the ones used."""
    from verl.protocol import DataProtoFuture as VerlDataProtoFuture

    from podium.controller.session.futures import PendingDataProtoFuture

    class NativeDataProtoFuture(PendingDataProtoFuture, VerlDataProtoFuture):
        """A PendingDataProtoFuture that is an instance of verl's DataProtoFuture too."""

        __slots__ = ()

    return NativeDataProtoFuture


def verl_future(outputs: list) -> Any:
    """The future over the ranks' ``outputs`` (ObjectRefs or PendingRefs) of a ``blocking=False``
    call whose results are concatenated, as an instance of :func:`verl_future_class`."""
    from podium.controller.session.futures import concat_refs

    concat_refs(outputs)  # the same checks (no futures of futures) as outside native mode
    return verl_future_class()(list(outputs))
