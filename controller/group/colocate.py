"""Colocation: several role classes hosted by ONE worker process (verl's WorkerDict/FusedWorker).

``create_colocated_worker_cls({"actor": ClassWithInitArgs(Actor), "critic": ...})``
returns a ClassWithInitArgs of a generated ``WorkerDict`` class. Each worker
process builds one WorkerDict, which builds every role in-process; role methods
appear prefixed (``actor_update_policy``) with the role's registration, and
``WorkerGroup.spawn({"actor", "critic"})`` gives per-role views over the same
processes. ``create_colocated_worker_raw_cls`` / ``create_colocated_worker_cls_fused``
are verl's FusedWorker (``_fuw_execute("actor_fwmn_update_policy", ...)``).

Generated classes record what the SDK needs on the class itself:

* ``role_names``: the role keys, in the given order;
* ``role_methods``: ``{role: {method: attribute}}`` of every bound role method
  (attribute is ``f"{role}_{method}"``, or ``method`` for an unprefixed direct
  rollout method), so a view maps names exactly instead of by ``startswith``;
* ``_podium_role_classes``: ``{role: class}``, which ``podium.worker.factory.by_value``
  follows so role classes defined beside the script travel by value.

The generated classes are local to a function, so cloudpickle pickles them by
value (with their role classes and init arguments).

Differences from verl: roles need not share a base class (the first role's
``MegatronWorker``/``Worker`` base is used as verl does, falling back to
``Worker``); two roles producing the same attribute name raise instead of one
silently replacing the other; fused workers support ``async def`` role methods
(through ``_fuw_execute_async``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from podium.errors import InvalidArgumentAssertion, InvalidArgumentError
from podium.worker.base import Worker
from podium.worker.decorator import MAGIC_ATTR, PODIUM_ATTR, Dispatch, get_registration
from podium.worker.factory import ClassWithInitArgs, _unwrap

__all__ = [
    "create_colocated_worker_cls",
    "create_colocated_worker_raw_cls",
    "create_colocated_worker_cls_fused",
    "FUSED_METHOD_SEPARATOR",
    "FUSED_WORKER_CLS_NAME",
]

#: Separator of ``_fuw_execute`` names: ``"{role}_fwmn_{method}"``.
FUSED_METHOD_SEPARATOR = "_fwmn_"
#: Name stem of fused classes: ``FusedWorker_actor_critic``.
FUSED_WORKER_CLS_NAME = "FusedWorker"


def _roles(class_dict: Mapping[str, Any]) -> dict[str, tuple[type, tuple, dict]]:
    """Validate ``class_dict`` into ``{role: (class, args, kwargs)}``."""
    if not isinstance(class_dict, Mapping) or not class_dict:
        raise InvalidArgumentError(f"colocation needs a non-empty dict of role -> ClassWithInitArgs, "
                                   f"got {class_dict!r}")
    roles: dict[str, tuple[type, tuple, dict]] = {}
    for key, cia in class_dict.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidArgumentError(f"role name {key!r} must be a Python identifier "
                                       f"(it becomes a method prefix)")
        if FUSED_METHOD_SEPARATOR in key:
            raise InvalidArgumentError(f"role name {key!r} must not contain {FUSED_METHOD_SEPARATOR!r}")
        if not all(hasattr(cia, a) for a in ("cls", "args", "kwargs")):
            raise InvalidArgumentError(f"role {key!r}: expected a ClassWithInitArgs, got {cia!r}")
        cls = _unwrap(cia.cls)
        if not isinstance(cls, type):
            raise InvalidArgumentError(f"role {key!r}: {cls!r} is not a class")
        roles[key] = (cls, tuple(cia.args), dict(cia.kwargs))
    return roles


def _base_class(first: type) -> type:
    # verl takes the base from the FIRST role's MRO (MegatronWorker or Worker).
    for klass in first.__mro__:
        if klass.__name__ == "MegatronWorker" and issubclass(klass, Worker):
            return klass
        if klass is Worker:
            return klass
    return Worker


def _registered_methods(cls: type) -> list[tuple[str, Callable]]:
    """``(name, function)`` of every registered method of ``cls``, alphabetically."""
    found = []
    for name in sorted(dir(cls)):
        try:
            member = getattr(cls, name)
        except Exception:  # a property or descriptor that fails on the class
            continue
        if callable(member) and get_registration(member) is not None:
            found.append((name, member))
    return found


def _delegate(role: str, method_name: str, original: Callable, attr_name: str,
              owner_qualname: str) -> Callable:
    """A method of the colocated class that calls ``self.worker_dict[role].<method_name>``."""
    async def delegate_async(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    def delegate_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    delegate: Callable = delegate_async if inspect.iscoroutinefunction(original) else delegate_sync
    delegate.__name__ = attr_name
    delegate.__qualname__ = f"{owner_qualname}.{attr_name}"
    delegate.__doc__ = original.__doc__ or f"{role}.{method_name}"
    # The outer WorkerGroup binds from these; the inner method still does the
    # future materialization, so the same flags describe the delegate truly.
    setattr(delegate, MAGIC_ATTR, getattr(original, MAGIC_ATTR))
    extra = getattr(original, PODIUM_ATTR, None)
    if extra is not None:
        setattr(delegate, PODIUM_ATTR, extra)
    return delegate


def create_colocated_worker_raw_cls_dict(class_dict: Mapping[str, Any]) -> type:
    """The WorkerDict class itself (what :func:`create_colocated_worker_cls` wraps)."""
    roles = _roles(class_dict)
    base = _base_class(next(iter(roles.values()))[0])

    base_init: Callable[[Any], None] = base.__init__  # type: ignore[misc]  # the class's own, on purpose

    def __init__(self: Any) -> None:
        base_init(self)
        self.worker_dict = {}
        for key, (cls, args, kwargs) in roles.items():
            # Each role's own Worker.__init__ reads the same env: same rank.
            self.worker_dict[key] = cls(*args, **kwargs)
        # Sibling roles see each other (a rollout takes the actor's weights in-process).
        for role in self.worker_dict.values():
            setattr(role, Worker.fused_worker_attr_name, self.worker_dict)

    namespace: dict[str, Any] = {"__init__": __init__,
                                 "__doc__": f"Colocated roles {', '.join(roles)} in one process."}
    role_methods: dict[str, dict[str, str]] = {}
    origin: dict[str, str] = {}
    for key, (cls, _, _) in roles.items():
        role_methods[key] = {}
        for method_name, method in _registered_methods(cls):
            reg = get_registration(method)
            if reg is None:  # _registered_methods lists registered methods only
                continue
            direct = reg["dispatch_mode"] is Dispatch.DIRECT_ROLLOUT_METHOD and "rollout" in key
            attr = method_name if direct else f"{key}_{method_name}"
            if attr in origin or hasattr(base, attr):
                other = origin.get(attr, base.__name__)
                raise InvalidArgumentError(
                    f"colocation conflict: role {key!r} method {method_name!r} would be bound as "
                    f"{attr!r}, which {other} already provides")
            origin[attr] = f"role {key!r}"
            namespace[attr] = _delegate(key, method_name, method, attr, "WorkerDict")
            role_methods[key][method_name] = attr
    namespace["role_names"] = tuple(roles)
    namespace["role_methods"] = role_methods
    namespace["_podium_role_classes"] = {key: cls for key, (cls, _, _) in roles.items()}
    return type("WorkerDict", (base,), namespace)


def create_colocated_worker_cls(class_dict: Mapping[str, Any]) -> ClassWithInitArgs:
    """One class hosting every role of ``class_dict`` in one process (verl's legacy API).

    ``class_dict`` maps role names to ClassWithInitArgs. Returns a
    ClassWithInitArgs (no init args) of a ``WorkerDict`` Worker subclass whose
    ``__init__`` runs ``Worker.__init__`` and then builds each role as
    ``self.worker_dict[role] = Cls(*args, **kwargs)``; each role's ``fused_worker_dict``
    is that shared dict, so ``get_fused_worker_by_name`` finds its siblings. Every registered method
    ``m`` of each role (Worker built-ins included) becomes ``f"{role}_{m}"`` with
    the same registration (async stays async); a ``DIRECT_ROLLOUT_METHOD`` method
    of a role whose name contains ``"rollout"`` is bound unprefixed. A name
    clash raises InvalidArgumentError.
    """
    return ClassWithInitArgs(create_colocated_worker_raw_cls_dict(class_dict))


def create_colocated_worker_raw_cls(class_dict: Mapping[str, Any]) -> type:
    """verl's FusedWorker: a ``FusedWorker_<role1>_<role2>...`` Worker subclass.

    Its ``__init__(*args, **kwargs)`` runs ``Worker.__init__`` with them, builds
    each role (``self.fused_worker_dict[role]``, also ``self.<role>``) and gives
    every role the shared ``fused_worker_dict``. ``_fuw_execute("role_fwmn_m", ...)``
    calls ``role.m`` (sync; use ``_fuw_execute_async`` for an ``async def`` method,
    which then runs on the worker's loop). Class attributes: ``is_fused_worker``,
    ``raw_cls_dict``, ``role_names``, ``role_methods``. Subclass it to add methods
    that use several roles (``self.actor``, ``self.critic``).
    """
    roles = _roles(class_dict)
    raw_cls_dict = {key: cls for key, (cls, _, _) in roles.items()}
    cls_name = "_".join([FUSED_WORKER_CLS_NAME, *roles])

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        Worker.__init__(self, *args, **kwargs)
        self.cls_names = list(roles)
        for key, (cls, role_args, role_kwargs) in roles.items():
            self.fused_worker_dict[key] = cls(*role_args, **role_kwargs)
            setattr(self, key, self.fused_worker_dict[key])
        # Sibling roles see each other (e.g. rollout reads the actor's weights).
        for role in self.fused_worker_dict.values():
            setattr(role, Worker.fused_worker_attr_name, self.fused_worker_dict)

    def _resolve(self: Any, method_name: str) -> Callable:
        role, sep, name = method_name.partition(FUSED_METHOD_SEPARATOR)
        if not sep or not name:
            raise InvalidArgumentError(f"fused method name {method_name!r} is not "
                                       f"'<role>{FUSED_METHOD_SEPARATOR}<method>'")
        if role not in self.fused_worker_dict:
            raise InvalidArgumentAssertion(f"calling {role}'s {name}, but {role} not in fused_worker_dict")
        return getattr(self.fused_worker_dict[role], name)

    def _fuw_execute(self: Any, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``role.method(*args, **kwargs)`` for ``method_name = "role_fwmn_method"``."""
        result = _resolve(self, method_name)(*args, **kwargs)
        if inspect.iscoroutine(result):
            # verl fails here (a coroutine cannot be pickled); run it to its end
            # on this thread instead. _fuw_execute_async runs it on the worker loop.
            import asyncio

            return asyncio.run(result)
        return result

    async def _fuw_execute_async(self: Any, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Async twin of ``_fuw_execute`` for ``async def`` role methods."""
        result = _resolve(self, method_name)(*args, **kwargs)
        if inspect.isawaitable(result):
            return await result
        return result

    role_methods = {key: {name: name for name, _ in _registered_methods(cls)}
                    for key, cls in raw_cls_dict.items()}
    namespace = {"__init__": __init__, "_fuw_execute": _fuw_execute,
                 "_fuw_execute_async": _fuw_execute_async,
                 "__doc__": f"Fused roles {', '.join(roles)} in one process.",
                 "is_fused_worker": True, "raw_cls_dict": raw_cls_dict,
                 "role_names": tuple(roles), "role_methods": role_methods,
                 "_podium_role_classes": raw_cls_dict}
    return type(cls_name, (Worker,), namespace)


def create_colocated_worker_cls_fused(class_dict: Mapping[str, Any]) -> ClassWithInitArgs:
    """ClassWithInitArgs of :func:`create_colocated_worker_raw_cls`, ``fused_worker_used=True``."""
    cia = ClassWithInitArgs(create_colocated_worker_raw_cls(class_dict))
    cia.fused_worker_used = True
    return cia
