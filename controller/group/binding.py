"""Binding a hosted class's ``@register``'ed methods onto a WorkerGroup.

Each bound method runs verl's pipeline through the group's call object: dispatch -> pop
padding -> execute (every rank, or rank 0) -> collect -> unpad. Which ranks run a method
is its registered ``Execute`` mode (``Execute.RANK_ZERO``: rank 0 only), read from the
method's registration, never from a function's name.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from podium.controller.dispatch import modes as _dispatch
from podium.tracering import RING, now_ns
from podium.errors import InvalidArgumentError
from podium.worker.decorator import MAGIC_ATTR, Execute, get_registration

__all__ = ["BindableGroup", "bind_worker_methods", "func_generator", "runs_on"]


class BindableGroup(Protocol):
    """What a bound method reads of its group, per call (a protocol, so the group's module
    imports this one and not the other way round)."""

    _calls: Any

    @property
    def world_size(self) -> int: ...


def runs_on(execute_mode: Any) -> Any:
    """Mark a group's execute function with the ``Execute`` mode it implements (the mode a
    bound method made with it as ``execute_fn`` runs under)."""
    def mark(fn: Callable) -> Callable:
        fn.execute_mode = execute_mode  # type: ignore[attr-defined]
        return fn
    return mark


def func_generator(self: BindableGroup, method_name: str, dispatch_fn: Callable, collect_fn: Callable,
                   execute_fn: Callable, blocking: bool, execute_mode: Any = None) -> Callable:
    """The bound method: an instance of a class named after ``method_name`` (for observability).

    ``execute_mode`` (an ``Execute`` member) says which ranks run it; without it, the mode
    ``execute_fn`` carries (see :func:`runs_on`; ``Execute.ALL`` when it carries none).
    """
    if execute_mode is None:
        execute_mode = getattr(execute_fn, "execute_mode", Execute.ALL)
    rank_zero = execute_mode is Execute.RANK_ZERO
    replicated = dispatch_fn is not _dispatch.dispatch_all_to_all
    one_to_all = dispatch_fn is _dispatch.dispatch_one_to_all

    def __call__(this: Any, *args: Any, **kwargs: Any) -> Any:
        calls = self._calls  # read per call: a fused view routes through its own
        if one_to_all and not rank_zero:
            # Every rank gets the very same arguments: one (args, kwargs) for all, encoded
            # once, without building and slicing N-long lists per argument (what
            # dispatch_one_to_all + slice_for_ranks would give, at O(N) Python per call).
            world_size = self.world_size
            output = calls.run(list(range(world_size)), method_name, [(args, kwargs)] * world_size, blocking)
            if not RING.on:
                return collect_fn(self, output)
            collecting = now_ns()
            output = collect_fn(self, output)
            RING.add("collect", f"{calls.label}.{method_name}", collecting, now_ns(), calls.last_trace)
            return output
        dispatching = now_ns() if RING.on else 0
        args, kwargs = dispatch_fn(self, *args, **kwargs)
        padding_count = kwargs.pop(_dispatch.PADDING_SIZE_KEY, 0)
        padded_rows = kwargs.pop(_dispatch.PADDED_ROWS_KEY, None)
        if rank_zero:
            if replicated:
                args, kwargs = _dispatch.slice_for_ranks(self.world_size, args, kwargs)[0]
            output = calls.run([0], method_name, [(tuple(args), dict(kwargs))], blocking)[0]
        else:
            per_rank = _dispatch.slice_for_ranks(self.world_size, args, kwargs)
            dispatched = now_ns() if dispatching else 0
            output = calls.run(list(range(self.world_size)), method_name, per_rank, blocking)
        collecting = now_ns() if dispatching else 0
        output = _dispatch.unpad_output(collect_fn(self, output), padding_count, padded_rows, self.world_size)
        if collecting:
            name = f"{calls.label}.{method_name}"
            if not rank_zero:
                RING.add("dispatch", name, dispatching, dispatched, calls.last_trace)
            RING.add("collect", name, collecting, now_ns(), calls.last_trace)
        return output

    cls = type(method_name, (), {"__call__": __call__,
                                 "__doc__": f"WorkerGroup method {method_name!r} (dispatch -> execute -> collect)."})
    return cls()


def bind_worker_methods(group: Any, user_defined_cls: Any,
                        generator: Callable = func_generator) -> list[str]:
    """Put a bound method on ``group`` for every registered method of the class (verl's
    ``_bind_worker_method``: ``dir()`` order, ``MAGIC_ATTR``); their names."""
    user_defined_cls = getattr(user_defined_cls, "__ray_actor_class__", user_defined_cls)
    names = []
    for name in dir(user_defined_cls):
        try:
            method = getattr(user_defined_cls, name)
        except Exception:
            continue
        if not callable(method) or not hasattr(method, MAGIC_ATTR):
            continue
        reg = get_registration(method)
        if reg is None:
            continue
        dispatch_mode, execute_mode = reg["dispatch_mode"], reg["execute_mode"]
        _dispatch._check_dispatch_mode(dispatch_mode)
        _dispatch._check_execute_mode(execute_mode)
        dispatch_fn, collect_fn = _dispatch.resolve_dispatch_mode(dispatch_mode)
        execute_fn = getattr(group, _dispatch.get_predefined_execute_fn(execute_mode)["execute_fn_name"])
        kwargs: dict[str, Any] = {"execute_mode": execute_mode} if generator is func_generator else {}
        try:
            setattr(group, name, generator(group, name, dispatch_fn=dispatch_fn, collect_fn=collect_fn,
                                           execute_fn=execute_fn, blocking=reg["blocking"], **kwargs))
        except Exception as exc:
            raise InvalidArgumentError(
                f"cannot bind the registered method {name!r} of {getattr(user_defined_cls, '__name__', '?')} "
                f"onto the WorkerGroup ({type(exc).__name__}: {exc}); rename the method if it "
                f"shadows a WorkerGroup attribute") from exc
        names.append(name)
    return names
