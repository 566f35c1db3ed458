"""``ClassWithInitArgs``: a deferred constructor, and how a class travels to a worker.

A WorkerGroup sends every worker process ``(cls_ref, args, kwargs)`` (the payload
of a ``CONSTRUCT`` call, encoded by :mod:`podium.codec`, which is cloudpickle
based). The worker process may not be able to import the class:

* classes in ``__main__`` (the user's script) are always pickled by value by
  cloudpickle;
* classes in a module that is neither part of an installed distribution
  (``site-packages``/``dist-packages``, the standard library, or a distribution's
  top-level package such as an editable install) nor part of ``podium`` (a file
  beside the script, a test module) must travel by value too: wrap the encode in
  :func:`by_value` (``with by_value(cwia): payload = codec.encode(cwia.construct_payload())``);
* everything else travels by reference, so an installed library's worker class is
  imported in the worker, not duplicated.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import cloudpickle

from podium.errors import InvalidArgumentError, NotFoundError

__all__ = ["ClassWithInitArgs", "RayClassWithInitArgs", "by_value", "needs_by_value", "resolve_class"]


def _unwrap(cls: Any) -> Any:
    # A class decorated with @ray.remote in a ported script: host the plain class.
    return getattr(cls, "__ray_actor_class__", cls)


class ClassWithInitArgs:
    """``cls(*args, **kwargs)``, deferred until a worker builds it (verl's class).

    ``fused_worker_used`` marks a ``create_colocated_worker_cls_fused`` class.
    ``update_options`` and ``set_additional_resource`` are accepted and stored for
    compatibility with ``RayClassWithInitArgs``; Podium's scheduler does not read them.
    """

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.fused_worker_used = False
        self._options: dict[str, Any] = {}
        self._additional_resource: dict[str, Any] | None = None

    def __call__(self) -> Any:
        """Build the object here, in this process."""
        return _unwrap(self.cls)(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"ClassWithInitArgs({getattr(_unwrap(self.cls), '__qualname__', self.cls)!r})"

    def update_options(self, options: dict[str, Any]) -> None:
        """Merge Ray actor options (stored only; kept for verl compatibility)."""
        self._options.update(options)

    def set_additional_resource(self, additional_resource: dict[str, Any]) -> None:
        """Record extra resources (stored only; kept for verl compatibility)."""
        self._additional_resource = additional_resource

    def construct_payload(self) -> tuple:
        """``(cls, args, kwargs)``: what a worker's CONSTRUCT call receives.

        Encode it inside ``with self.by_value():`` so classes that the worker
        cannot import travel by value.
        """
        return _unwrap(self.cls), self.args, self.kwargs

    def by_value(self) -> contextlib.AbstractContextManager[None]:
        """Same as ``by_value(self)``."""
        return by_value(self)


#: verl's name for the same thing.
RayClassWithInitArgs = ClassWithInitArgs


# --------------------------------------------------------------------------- by value


@functools.lru_cache(maxsize=1)
def _distribution_top_levels() -> frozenset[str]:
    from importlib.metadata import packages_distributions

    try:
        return frozenset(packages_distributions())
    except Exception:  # a broken dist-info must not break pickling
        return frozenset()


def _is_installed(module: types.ModuleType) -> bool:
    name = module.__name__
    top = name.partition(".")[0]
    if top == "podium" or top in sys.builtin_module_names or top in sys.stdlib_module_names:
        return True
    path = getattr(module, "__file__", None)
    if not path:
        # A module built at run time cannot be imported in the worker.
        return False
    parts = os.path.realpath(path).split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return True
    # Editable installs live outside site-packages but are still importable
    # wherever the distribution is installed.
    return top in _distribution_top_levels()


def needs_by_value(module_name: str | None) -> bool:
    """True when objects of module ``module_name`` must be pickled by value."""
    if not module_name or module_name == "__main__":
        # cloudpickle already pickles __main__ objects by value.
        return False
    module = sys.modules.get(module_name)
    return module is not None and not _is_installed(module)


def _modules_of(obj: Any, seen: set[int], out: set[str]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, ClassWithInitArgs):
        _modules_of(_unwrap(obj.cls), seen, out)
        for value in (*obj.args, *obj.kwargs.values()):
            _modules_of(value if isinstance(value, (type, types.FunctionType)) else type(value),
                        seen, out)
        return
    if isinstance(obj, type):
        for klass in obj.__mro__:
            out.add(klass.__module__)
        # Colocated classes carry their role classes (see podium.controller.group.colocate).
        for role in getattr(obj, "_podium_role_classes", {}).values():
            _modules_of(role, seen, out)
        return
    if isinstance(obj, types.FunctionType):
        out.add(obj.__module__)
    elif isinstance(obj, types.ModuleType):
        out.add(obj.__name__)


_lock = threading.Lock()
_held: dict[str, int] = {}


@contextlib.contextmanager
def by_value(*objs: Any) -> Iterator[None]:
    """Pickle the not-importable modules behind ``objs`` by value while inside.

    ``objs`` are classes, functions, modules or ClassWithInitArgs (then its
    class, the classes of its top-level arguments and, for colocated classes,
    every role class). Only modules named this way are covered: when a class's
    methods use a *second* local module, name that module too. A module that was
    already registered by value stays registered. Nesting and concurrent use
    from several threads are safe.
    """
    names: set[str] = set()
    seen: set[int] = set()
    for obj in objs:
        _modules_of(obj, seen, names)
    taken: list[str] = []
    with _lock:
        for name in sorted(names):
            if not needs_by_value(name):
                continue
            if name in _held:
                _held[name] += 1
            elif name in cloudpickle.list_registry_pickle_by_value():
                continue  # registered by someone else (e.g. the codec): leave it
            else:
                cloudpickle.register_pickle_by_value(sys.modules[name])
                _held[name] = 1
            taken.append(name)
    try:
        yield
    finally:
        from podium.codec import pinned_by_value

        with _lock:
            for name in taken:
                _held[name] -= 1
                if _held[name] == 0:
                    del _held[name]
                    module = sys.modules.get(name)
                    # A test module the codec registered meanwhile (pickling one of its
                    # objects) stays by value: the codec checks each module only once.
                    if module is not None and not pinned_by_value(name):
                        with contextlib.suppress(ValueError):
                            cloudpickle.unregister_pickle_by_value(module)


def resolve_class(cls_ref: Any) -> type:
    """The class named by ``cls_ref``: a class (returned as is) or ``"module:qualname"``.

    ``"module.qualname"`` (last dot) is accepted too. NotFoundError when the
    module or attribute does not exist, InvalidArgumentError for anything else.
    """
    if isinstance(cls_ref, type):
        return _unwrap(cls_ref)
    if not isinstance(cls_ref, str) or not cls_ref.strip():
        raise InvalidArgumentError(f"a class reference must be a class or a 'module:qualname' "
                                   f"string, got {cls_ref!r}")
    if ":" in cls_ref:
        module_name, _, qualname = cls_ref.partition(":")
    else:
        module_name, _, qualname = cls_ref.rpartition(".")
    if not module_name or not qualname:
        raise InvalidArgumentError(f"class reference {cls_ref!r} is not 'module:qualname'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise NotFoundError(f"cannot import module {module_name!r} for class {cls_ref!r}: {exc}") from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise NotFoundError(f"module {module_name!r} has no attribute {qualname!r}") from None
    if not isinstance(obj, type):
        raise InvalidArgumentError(f"{cls_ref!r} names a {type(obj).__name__}, not a class")
    return _unwrap(obj)
