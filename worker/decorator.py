"""``@register`` and its enums: how a worker method says it wants to be called.

Names and semantics follow ``verl.single_controller.base.decorator`` so a verl
script ports by changing imports:

* :class:`DynamicEnum`, :class:`Dispatch` (``RANK_ZERO, ONE_TO_ALL, ALL_TO_ALL,
  DP_COMPUTE, DP_COMPUTE_PROTO, DP_COMPUTE_PROTO_WITH_FUNC, DP_COMPUTE_METRIC,
  DIRECT_ROLLOUT_METHOD``, values 0..7) and :class:`Execute` (``ALL``, ``RANK_ZERO``);
* :data:`MAGIC_ATTR` on every registered function, holding exactly verl's
  ``{"dispatch_mode", "execute_mode", "blocking"}``;
* :func:`register`, which validates the modes when the class body runs and, in
  the worker, replaces top-level ``DataProtoFuture`` arguments by their values.

Podium additions: :data:`PODIUM_ATTR` (the ``materialize_futures`` flag, which
verl does not store), :func:`get_registration` and :func:`method_table` (the one
description of a class's methods that the worker host serves in ``Describe`` and
the controller binds from).

The dispatch/collect *functions* (``DISPATCH_MODE_FN_REGISTRY``,
``register_dispatch_mode``) live in ``podium.controller.dispatch.modes``: they run on
the controller, and this module must stay free of torch and grpc.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from podium.errors import InvalidArgumentError

__all__ = [
    "MAGIC_ATTR",
    "PODIUM_ATTR",
    "CUSTOM_DISPATCH",
    "DynamicEnum",
    "Dispatch",
    "Execute",
    "register",
    "get_registration",
    "is_async_method",
    "method_table",
]

#: Attribute verl's WorkerGroup looks for on a registered function.
MAGIC_ATTR = "attrs_3141562937"

#: Podium's own attribute beside MAGIC_ATTR: ``{"materialize_futures": bool}``.
#: Kept apart so MAGIC_ATTR holds exactly what verl's holds.
PODIUM_ATTR = "_podium_register_attrs"

#: ``dispatch_mode`` name reported for a ``{dispatch_fn, collect_fn}`` dict.
CUSTOM_DISPATCH = "CUSTOM"


# --------------------------------------------------------------------------- enums


class DynamicEnumMeta(type):
    """Class-level protocol of :class:`DynamicEnum`: iteration, ``in``, ``[name]``."""

    def __iter__(cls) -> Iterator[Any]:
        return iter(list(cls._registry.values()))

    def __contains__(cls, item: Any) -> bool:
        # Accept a name or a member, as verl does.
        if isinstance(item, str):
            return item in cls._registry
        return any(item is member for member in cls._registry.values())

    if TYPE_CHECKING:
        # Members are added at run time (Dispatch.ONE_TO_ALL, a registered TEST_MODE):
        # tell the type checker that any attribute of an enum class may be one.
        def __getattr__(cls, name: str) -> Any: ...

    def __getitem__(cls, name: str) -> Any:
        return cls._registry[name]

    def __len__(cls) -> int:
        return len(cls._registry)

    def names(cls) -> list[str]:
        """Member names in registration order."""
        return list(cls._registry.keys())

    def values(cls) -> list[Any]:
        """Members in registration order."""
        return list(cls._registry.values())


class DynamicEnum(metaclass=DynamicEnumMeta):
    """An enum whose members can be added and removed at run time (verl's).

    Each subclass has its own registry. Members compare by identity, are
    reachable as class attributes and pickle *by name*, so an unpickled member is
    the very object of the receiving process (a custom member must therefore be
    registered there too).
    """

    _registry: dict[str, DynamicEnum] = {}
    _next_value: int = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A fresh registry per subclass: members of Dispatch are not Execute's.
        cls._registry = {}
        cls._next_value = 0

    def __init__(self, name: str, value: int) -> None:
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # By name, through the class found by import: the receiver reuses its
        # own member instead of building a second one that compares unequal.
        module = importlib.import_module(type(self).__module__)
        return _member_by_name, (getattr(module, type(self).__qualname__), self.name)

    @classmethod
    def register(cls, name: str) -> DynamicEnum:
        """Add member ``name.upper()``; InvalidArgumentError (a ValueError) if it exists."""
        key = name.upper()
        if key in cls._registry:
            raise InvalidArgumentError(f"{key} already registered in {cls.__name__} "
                                       f"(a name is registered once per process)")
        member = cls(key, cls._next_value)
        cls._registry[key] = member
        setattr(cls, key, member)
        cls._next_value += 1
        return member

    @classmethod
    def remove(cls, name: str) -> DynamicEnum:
        """Remove and return member ``name.upper()``; KeyError if unknown."""
        key = name.upper()
        member = cls._registry.pop(key)
        delattr(cls, key)
        return member

    @classmethod
    def from_name(cls, name: str) -> DynamicEnum | None:
        """The member called ``name`` (case-insensitive), or None."""
        return cls._registry.get(name.upper())


def _member_by_name(enum_cls: DynamicEnumMeta, name: str) -> DynamicEnum:
    """Unpickle a member: the receiver's own, registered on the fly when unknown.

    verl fails here when a custom Dispatch mode was registered only in the
    controller's script; a worker needs just the member (its dispatch and
    collect functions run on the controller), so Podium adds it.
    """
    member = enum_cls.from_name(name)
    return member if member is not None else enum_cls.register(name)


class Dispatch(DynamicEnum):
    """How a WorkerGroup call splits its arguments over ranks and joins results.

    ``docs/dispatch.md`` says what each rank receives and what the caller gets back. Extend it with
    ``podium.controller.dispatch.register_dispatch_mode``.
    """


class Execute(DynamicEnum):
    """Which ranks run a call: ``ALL`` or ``RANK_ZERO``."""


def _init_predefined() -> None:
    for name in ("RANK_ZERO", "ONE_TO_ALL", "ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_PROTO",
                 "DP_COMPUTE_PROTO_WITH_FUNC", "DP_COMPUTE_METRIC", "DIRECT_ROLLOUT_METHOD"):
        Dispatch.register(name)
    for name in ("ALL", "RANK_ZERO"):
        Execute.register(name)


_init_predefined()


# --------------------------------------------------------------------------- validation


def _check_dispatch_mode(dispatch_mode: Any) -> None:
    if isinstance(dispatch_mode, Dispatch):
        return
    if isinstance(dispatch_mode, dict):
        missing = [k for k in ("dispatch_fn", "collect_fn") if k not in dispatch_mode]
        if not missing:
            return
        raise InvalidArgumentError(
            f"register(dispatch_mode=...): a custom dispatch dict needs both 'dispatch_fn' and "
            f"'collect_fn'; {dispatch_mode!r} lacks {', '.join(repr(m) for m in missing)}")
    raise InvalidArgumentError(
        f"register(dispatch_mode=...) takes a Dispatch member or a dict with 'dispatch_fn' and "
        f"'collect_fn', got {dispatch_mode!r} ({type(dispatch_mode).__name__})")


def _check_execute_mode(execute_mode: Any) -> None:
    if not isinstance(execute_mode, Execute):
        raise InvalidArgumentError(
            f"register(execute_mode=...) takes an Execute member (Execute.ALL or "
            f"Execute.RANK_ZERO), got {execute_mode!r} ({type(execute_mode).__name__})")


# --------------------------------------------------------------------------- futures


_FUTURE_MODULES = ("podium.refs", "podium.dataproto")
_future_types_found: tuple[type, ...] | None = None


def _future_types() -> tuple[type, ...]:
    # A DataProtoFuture can only exist here if its module was imported, so
    # looking in sys.modules costs nothing and never imports torch. Once both modules
    # are imported (and the class was found) the answer is final: kept, as this runs on
    # every call.
    global _future_types_found
    if _future_types_found is not None:
        return _future_types_found
    found: list[type] = []
    for module_name in _FUTURE_MODULES:
        module = sys.modules.get(module_name)
        cls = getattr(module, "DataProtoFuture", None) if module is not None else None
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    if found and all(name in sys.modules for name in _FUTURE_MODULES):
        _future_types_found = tuple(found)
    return tuple(found)


def _materialize_futures(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Replace top-level DataProtoFuture arguments by ``.get()`` (nested ones stay)."""
    if not (args or kwargs):  # checked first: most calls carry nothing, and this is per call
        return args, kwargs
    kinds = _future_types()
    if not kinds:
        return args, kwargs
    if not any(isinstance(v, kinds) for v in (*args, *kwargs.values())):
        return args, kwargs  # the common case: no copies on the call path
    args = tuple(_value_of(a) if isinstance(a, kinds) else a for a in args)
    kwargs = {k: (_value_of(v) if isinstance(v, kinds) else v) for k, v in kwargs.items()}
    return args, kwargs


def _value_of(future: Any) -> Any:
    """A DataProtoFuture's value (its ``get()``)."""
    return future.get()


async def _aresolve(future: Any) -> Any:
    aget = getattr(future, "aget", None)
    if aget is not None:
        return await aget()
    # A future without an async getter must not block the worker's loop.
    import asyncio

    return await asyncio.to_thread(future.get)


async def _amaterialize_futures(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Async twin of :func:`_materialize_futures`: ``await .aget()`` on each future,
    all fetched concurrently."""
    if not (args or kwargs):
        return args, kwargs
    kinds = _future_types()
    if not kinds:
        return args, kwargs
    arg_slots = [i for i, a in enumerate(args) if isinstance(a, kinds)]
    kw_slots = [k for k, v in kwargs.items() if isinstance(v, kinds)]
    if not arg_slots and not kw_slots:
        return args, kwargs
    import asyncio

    values = await asyncio.gather(*(_aresolve(args[i]) for i in arg_slots),
                                  *(_aresolve(kwargs[k]) for k in kw_slots))
    new_args = list(args)
    for i, value in zip(arg_slots, values[:len(arg_slots)]):
        new_args[i] = value
    new_kwargs = dict(kwargs)
    for k, value in zip(kw_slots, values[len(arg_slots):]):
        new_kwargs[k] = value
    return tuple(new_args), new_kwargs


# --------------------------------------------------------------------------- register


def register(dispatch_mode: Any = Dispatch.ALL_TO_ALL, execute_mode: Any = Execute.ALL,
             blocking: bool = True, materialize_futures: bool = True) -> Callable[[Callable], Callable]:
    """Mark a worker method for binding on a WorkerGroup (verl's ``@register``).

    ``dispatch_mode`` is a :class:`Dispatch` member or a dict with ``dispatch_fn``
    and ``collect_fn``; ``execute_mode`` an :class:`Execute` member; both are
    checked here, when the class body runs (InvalidArgumentError, a ValueError,
    naming the bad value). ``blocking=False`` makes the WorkerGroup call return
    futures. With ``materialize_futures`` the worker replaces top-level
    DataProtoFuture arguments by their values before the method runs
    (``.get()`` for a sync method, ``await .aget()`` for an ``async def`` one).
    Called on a local object, the method behaves like the plain method.
    """
    _check_dispatch_mode(dispatch_mode)
    _check_execute_mode(execute_mode)
    materialize = bool(materialize_futures)
    attrs = {"dispatch_mode": dispatch_mode, "execute_mode": execute_mode, "blocking": blocking}

    def decorator(func: Callable) -> Callable:
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                if materialize:
                    args, kwargs = await _amaterialize_futures(args, kwargs)
                return await func(*args, **kwargs)

            wrapper: Callable = async_inner
        else:
            # A method's first argument is its object, never a future: a call with nothing
            # more skips the look for futures (it runs on every call).
            code = getattr(func, "__code__", None)
            own = 1 if code is not None and code.co_argcount and code.co_varnames[0] == "self" else 0

            @functools.wraps(func)
            def inner(*args: Any, **kwargs: Any) -> Any:
                if materialize and (kwargs or len(args) > own):
                    args, kwargs = _materialize_futures(args, kwargs)
                return func(*args, **kwargs)

            wrapper = inner
        setattr(wrapper, MAGIC_ATTR, attrs)
        setattr(wrapper, PODIUM_ATTR, {"materialize_futures": materialize})
        return wrapper

    return decorator


def get_registration(func: Any) -> dict | None:
    """``{"dispatch_mode", "execute_mode", "blocking", "materialize_futures"}`` of a
    registered function or bound method, or None when it is not registered.

    A function registered by verl's own decorator (MAGIC_ATTR only) reports
    ``materialize_futures=True``, verl's default, and its modes as Podium's members of the
    same name (verl's ``Dispatch.ONE_TO_ALL`` is this module's).
    """
    attrs = getattr(func, MAGIC_ATTR, None)
    if not isinstance(attrs, dict):
        return None
    extra = getattr(func, PODIUM_ATTR, None) or {}
    return {"dispatch_mode": _own_member(attrs.get("dispatch_mode", Dispatch.ALL_TO_ALL), Dispatch),
            "execute_mode": _own_member(attrs.get("execute_mode", Execute.ALL), Execute),
            "blocking": attrs.get("blocking", True),
            "materialize_futures": extra.get("materialize_futures", True)}


def _own_member(mode: Any, enum: Any) -> Any:
    """``mode`` as ``enum``'s member when it is another library's member of an enum of the
    same class name and member name (verl's own ``Dispatch``/``Execute``); else unchanged."""
    if isinstance(mode, enum) or isinstance(mode, dict):
        return mode
    name = getattr(mode, "name", None)
    if type(mode).__name__ == enum.__name__ and isinstance(name, str) and name in enum:
        return enum[name]
    return mode


def _mode_name(mode: Any) -> str:
    if isinstance(mode, DynamicEnum):
        return mode.name
    if isinstance(mode, dict):
        return CUSTOM_DISPATCH
    return str(mode)


def is_async_method(method: Any) -> bool:
    """Whether calling ``method`` returns a coroutine (``async def``, or an object
    with an ``async def __call__``)."""
    if inspect.iscoroutinefunction(method):
        return True
    # A callable object with an async __call__ (rare, but bindable).
    call = getattr(type(method), "__call__", None)
    return not inspect.isroutine(method) and inspect.iscoroutinefunction(call)


#: Former private name, still imported by the worker host.
_is_async = is_async_method


def method_table(obj_or_cls: Any) -> list[dict]:
    """Describe the callable attributes of a class or instance, alphabetically.

    Walks ``dir()`` as verl's ``_bind_worker_method`` does, skipping attributes
    whose ``getattr`` raises or that are not callable (properties of a class,
    data attributes). Lists every registered method (underscore names too, e.g.
    ``_query_dispatch_info``) and every public unregistered one. Each row:

    ``name``; ``dispatch_mode`` (the member name, ``"CUSTOM"`` for a dict, ``""``
    when unregistered); ``dispatch`` (the raw Dispatch member or dict, None when
    unregistered: cloudpickle it to ship a CUSTOM mode); ``execute_mode`` (name
    or ``""``); ``blocking``; ``materialize_futures``; ``is_async``; ``registered``.
    """
    rows: list[dict] = []
    for name in sorted(dir(obj_or_cls)):
        try:
            member = getattr(obj_or_cls, name)
        except Exception:  # properties evaluated on a half-built object raise anything
            continue
        if not callable(member):
            continue
        reg = get_registration(member)
        if reg is None:
            if name.startswith("_") or isinstance(member, type):
                continue
            rows.append({"name": name, "dispatch_mode": "", "dispatch": None, "execute_mode": "",
                         "blocking": True, "materialize_futures": False,
                         "is_async": is_async_method(member), "registered": False})
            continue
        rows.append({"name": name, "dispatch_mode": _mode_name(reg["dispatch_mode"]),
                     "dispatch": reg["dispatch_mode"],
                     "execute_mode": _mode_name(reg["execute_mode"]),
                     "blocking": bool(reg["blocking"]),
                     "materialize_futures": bool(reg["materialize_futures"]),
                     "is_async": is_async_method(member), "registered": True})
    return rows
