"""Single actors (Ray's ``@ray.remote`` classes): one worker process each, the same worker
processes a WorkerGroup runs, driven through a one-worker group.

``podium.remote(Cls).options(...).remote(*args)`` reserves the actor's resources (its own
one-bundle placement group, pinned to a node when asked, or a bundle of a placement group it
is given), starts the worker,
builds ``Cls(*args)`` there and returns an :class:`ActorHandle`; ``handle.method.remote(...)``
returns a ref (``podium.get`` it) and never blocks. Named actors are found again, also from
another controller process, with :func:`get_actor`; :func:`kill` stops one.

As in Ray, ``.remote()`` returns while the constructor runs (verl's workers rendezvous in
``__init__``: rank 0 waits there for ranks not created yet); method calls made meanwhile
are sent once it finished, in order, and fail with its error (RemoteError) when it failed,
which also stops the actor. Where Podium differs from Ray: names live in the namespace
``"default"`` unless one is given, so any controller of the cluster finds them; a dead
actor's calls fail with WorkerDiedError unless it has ``max_restarts`` (its owner restarts
it: :mod:`.restarts`, :mod:`.actorcalls`).

A handle travels: pickled into the arguments of a call, a task or another actor's
constructor, or into a result, at any depth, it arrives as a working handle. The receiving
process attaches to the actor directly (its own session with the cluster, the cluster
token), on the handle's first use, never through the process that created the actor. Its
lifetime follows Ray's owner rule: a non-detached actor lives while its owner (the process
that created it) lives and holds a handle; handles other processes borrowed do not keep it
alive past that, and a call through one to an actor that is gone fails with
``WorkerDiedError`` (Ray's ``ActorDiedError``) naming the actor. Where Ray differs: Ray also
keeps an actor alive while a borrower holds a handle after the owner dropped its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import secrets
import time
import types
from typing import TYPE_CHECKING, Any

from podium.controller.remote.actorplace import (attached, construct, create_worker, described_once_read, remove,
                                                 reserve)
from podium.controller.remote.actoroptions import (DEFAULT_NAMESPACE, Options, captured, check_call_options,
                                                   parse_options, retry_count, retry_exceptions)
from podium.controller.remote.returns import check_num_returns, split_returns
from podium.controller.remote.streams import Streaming, check_buffer, method_returns, returns_from, stream_call
from podium.controller.group import build as _build, life as _life
from podium.controller.group.handle import WorkerHandle
from podium.controller.group.handle import class_name as _class_name
from podium.controller.session.argrefs import refs_inside
from podium.controller.session.runtime import get_runtime
from podium.errors import (AlreadyExistsError, ArgumentMismatchError, InvalidArgumentError, NotFoundError,
                           UnimplementedError)
from podium.worker.actorshell import (GROUP_CALL, READY_CALL, ActorShell, check_method_groups, is_async_class,
                                      method_groups)
from podium.worker.factory import ClassWithInitArgs, by_value
from podium.worker.processenv import WithProcessEnv


if TYPE_CHECKING:
    from podium.controller.session.contract import Session

__all__ = ["ActorClass", "ActorHandle", "ActorMethod", "get_actor", "kill", "actor_worker_name",
           "start_actor"]

#: Prefix of the worker (and placement group) names of actors.
_PREFIX = "actor:"


def actor_worker_name(name: str, namespace: str = DEFAULT_NAMESPACE) -> str:
    """The cluster-wide worker name of the actor called ``name`` in ``namespace``."""
    return f"{_PREFIX}{namespace}:{name}"


class ActorMethod:
    """``handle.method``: ``.remote(*args, **kwargs)`` calls it and returns a ref at once."""

    __slots__ = ("_handle", "_name", "_retries", "_retry_exceptions", "_num_returns")

    def __init__(self, handle: "ActorHandle", name: str, retries: int | None = None,
                 retry_exceptions: Any = False, num_returns: int | Streaming | None = None) -> None:
        self._handle = handle
        self._name = name
        #: This call's num_returns (None: the method's, from ray.method, else 1).
        self._num_returns = num_returns
        #: This call's max_task_retries (None: the actor's).
        self._retries = retries
        self._retry_exceptions = retry_exceptions

    def _target(self, args: tuple) -> tuple[str, tuple]:
        """What the worker runs for a call of this method: (method name, arguments)."""
        return self._name, args

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method on the actor; a PendingRef (``get`` gives its value), which keeps the
        actor alive while it lives."""
        handle = self._handle
        n = self._num_returns or handle._returns.get(self._name, 1)
        spec = handle._info.spec
        retries = spec.max_task_retries if self._retries is None else self._retries
        if type(n) is Streaming:
            return self._stream(n, retries, args, kwargs)
        name, args = self._target(args)
        if spec.max_restarts or retries or self._retry_exceptions:  # Ray's restart and retry rules
            from podium.controller.remote.actorcalls import actor_call
            return self._returned(actor_call(handle, name, args, kwargs, retries, self._retry_exceptions), n)
        ref = handle._group._calls.run([0], name, [(args, kwargs)], blocking=False)[0]
        ref.keep = handle
        return self._returned(ref, n)

    @staticmethod
    def _returned(ref: Any, n: Any) -> Any:
        """The ref of one call, or its N refs with ``num_returns=N`` (see returns)."""
        return ref if n == 1 else split_returns(ref, n)

    def _stream(self, streaming: Streaming, retries: int, args: tuple, kwargs: dict) -> Any:
        """A ``num_returns="streaming"`` call: its ObjectRefGenerator (controller.remote.streams)."""
        if retries or self._retry_exceptions:
            raise UnimplementedError(f"{self._name}: a num_returns='streaming' call is not retried by Podium "
                                     f"(max_task_retries={retries}, retry_exceptions={self._retry_exceptions!r}): "
                                     "call it with .options(max_task_retries=0, retry_exceptions=False) and start "
                                     "the stream again yourself when it fails")
        return stream_call(self._handle._group._calls, self._name, args, kwargs, streaming,
                           getattr(self, "_group_name", None), keep=self._handle)

    def options(self, **options: Any) -> "ActorMethod":
        """Ray's per-call options: ``concurrency_group`` (this call runs in that group of the
        actor's), ``max_task_retries``, ``retry_exceptions`` and ``num_returns``; the others as
        :func:`~podium.controller.remote.actoroptions.check_call_options` answers them (refused
        ones raise NotImplementedError naming the alternative)."""
        group = options.pop("concurrency_group", getattr(self, "_group_name", None))
        n = options.pop("num_returns", None)
        num_returns = check_num_returns(n) if n is not None else self._num_returns
        backpressure = options.pop("_generator_backpressure_num_objects", None)
        if backpressure is not None:  # (bounds a streaming call's items; a call of one ref has none)
            streams = num_returns or (self._handle._returns.get(self._name, 1) if self._handle is not None else 1)
            if type(streams) is Streaming:
                num_returns = Streaming(backpressure)
            else:
                check_buffer(backpressure)
        retries, retry_exc = self._retries, self._retry_exceptions
        check_call_options(options)
        if "max_task_retries" in options:
            retries = retry_count("max_task_retries", options["max_task_retries"])
        if "retry_exceptions" in options:
            retry_exc = retry_exceptions(options["retry_exceptions"])
        if group is None:
            return ActorMethod(self._handle, self._name, retries, retry_exc, num_returns)
        return _MethodInGroup(self._handle, self._name, _check_group_name(group), retries, retry_exc, num_returns)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ArgumentMismatchError(
            f"actor methods are called with '.{self._name}.remote(...)', not '.{self._name}(...)'")


def _check_group_name(group: Any) -> str:
    if not isinstance(group, str) or not group:
        raise InvalidArgumentError(f"concurrency_group must be a group's name, got {group!r}")
    return group


class _MethodInGroup(ActorMethod):
    """``handle.method.options(concurrency_group=g)``: its calls run in the actor's group ``g``
    (the actor's shell runs them there: ``ActorShell._podium_call_in_group``)."""

    __slots__ = ("_group_name",)

    def __init__(self, handle: "ActorHandle", name: str, group: str, retries: int | None = None,
                 retry_exceptions: Any = False, num_returns: int | Streaming | None = None) -> None:
        super().__init__(handle, name, retries, retry_exceptions, num_returns)
        self._group_name = group

    def _target(self, args: tuple) -> tuple[str, tuple]:
        return GROUP_CALL, (self._group_name, self._name, *args)


class _ActorId(str):
    """An actor's id as Ray code reads it: ``hex()`` gives the text (here its worker name)."""

    def hex(self) -> str:
        """The id as text."""
        return str(self)




class ActorHandle:
    """A handle to one actor; copies share it. When the last handle to a non-detached actor
    this controller created is garbage, the actor stops and its resources are freed. Pickled,
    it travels to other processes as a borrowed handle (see the module docstring)."""

    def __init__(self, group: Any, class_name: str, name: str | None, namespace: str,
                 info: Any = None, returns: dict[str, int] | None = None) -> None:
        self._attached_group = group
        #: ``num_returns`` of the methods ``ray.method`` marked (by name; others return one).
        self._returns = returns or {}
        #: The actor's WorkerInfo (what a borrowed handle attaches with).
        self._info = info if info is not None else group.workers[0].info
        self._class_name = class_name
        self._actor_name = name
        self._namespace = namespace

    @property
    def _group(self) -> Any:
        """The actor's one-worker group, attached on first use in a process that borrowed it."""
        group = self._attached_group
        if group is None:
            group = attached.get(self._info.id)
            if group is None:
                try:
                    group = _attached_group(get_runtime(), self._info, owns=False)
                except Exception:
                    if not self._info.spec.max_restarts:
                        raise
                    group = _attach_newest(self._info)  # it was restarted since the handle was made
            self._attached_group = group
        return group

    @property
    def __ray_ready__(self) -> ActorMethod:
        """Ray's ``actor.__ray_ready__.remote()``: a ref whose value is True once the actor's
        constructor ran (its error if it failed). A constructor may take as long as it takes;
        ``get(ref, timeout=...)`` is how a caller bounds it, as in Ray."""
        return ActorMethod(self, READY_CALL)

    @property
    def worker(self) -> Any:
        """The actor's :class:`~podium.controller.group.WorkerHandle` (node, pid, address)."""
        return self._group.workers[0]

    @property
    def _actor_id(self) -> "_ActorId":
        """Ray's ``handle._actor_id`` (verl reads ``.hex()``): the actor's cluster-wide worker name."""
        return _ActorId(self._info.spec.name)

    def __getattr__(self, name: str) -> ActorMethod:
        # As Ray: any method, private ones too (verl calls worker._query_dispatch_info);
        # only dunder probes (copy, pickle, inspect) and the handle's own fields are refused.
        if name.startswith("__") or name in ("_attached_group", "_info", "_class_name", "_actor_name",
                                             "_namespace", "_returns"):
            raise AttributeError(name)
        return ActorMethod(self, name)

    def __copy__(self) -> "ActorHandle":
        return ActorHandle(self._attached_group, self._class_name, self._actor_name, self._namespace, self._info,
                           self._returns)

    def __deepcopy__(self, memo: dict) -> "ActorHandle":
        return self.__copy__()

    def __reduce__(self):
        info = self._attached_group.workers[0].info if self._attached_group is not None else self._info
        return (_borrowed, (info.SerializeToString(), self._class_name, self._actor_name, self._namespace,
                            self._returns))

    def __repr__(self) -> str:
        label = f" name={self._actor_name!r}" if self._actor_name else ""
        return f"ActorHandle({self._class_name}{label}, worker={self._info.spec.name!r})"


def _attach_newest(info: Any) -> Any:
    """The group of the actor's newest live worker (by its name), for a restarted actor."""
    rt = get_runtime()
    newest = rt.run(rt.scheduler.get_workers(names=[info.spec.name]), timeout=60, what="finding a restarted actor")
    group = attached.get(newest[0].id)
    return group if group is not None else _attached_group(rt, newest[0], owns=False)


def _borrowed(info: bytes, class_name: str, name: str | None, namespace: str,
              returns: dict[str, int] | None = None) -> ActorHandle:
    """A handle unpickled in this process: attached on first use (see :class:`ActorHandle`)."""
    from podium.v1 import common_pb2

    worker = common_pb2.WorkerInfo.FromString(info)
    return ActorHandle(attached.get(worker.id), class_name, name, namespace, worker, returns)


class ActorClass:
    """``podium.remote(Cls)``: ``.remote(*args)`` starts an actor, ``.options(...)`` sets its
    resources, name, lifetime and placement (Ray's options; see actoroptions)."""

    def __init__(self, cls: type, options: Options | None = None) -> None:
        self.__ray_actor_class__ = cls  # what ClassWithInitArgs and verl unwrap
        # Ray's ActorClassMetadata fields that frameworks read (ROLL: modified_class).
        self.__ray_metadata__ = types.SimpleNamespace(modified_class=cls, class_name=getattr(cls, "__name__", "Actor"),
                                                      module_name=getattr(cls, "__module__", ""))
        self._options = options or Options()
        self.__name__ = getattr(cls, "__name__", "Actor")
        self.__doc__ = cls.__doc__

    def options(self, **options: Any) -> "ActorClass":
        """A copy with these options on top (Ray's ``.options``)."""
        return ActorClass(self.__ray_actor_class__, parse_options(options, actor=True, base=self._options))

    def remote(self, *args: Any, **kwargs: Any) -> ActorHandle:
        """Start the actor and build ``Cls(*args, **kwargs)`` in it."""
        return start_actor(self.__ray_actor_class__, self._options, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        # Ray's ActorClass shows the class's own attributes: verl lists the @register methods
        # of ray.remote(Cls) with dir() and reads class attributes (raw_cls_dict) through it.
        if name.startswith("__") or name == "_options":
            raise AttributeError(name)
        cls = self.__dict__["__ray_actor_class__"]
        value = getattr(cls, name)
        # A staticmethod comes back unbound, as from Ray's (NeMo-RL calls
        # ``ray.remote(Worker).configure_worker(num_gpus=...)``, a staticmethod).
        if isinstance(value, types.FunctionType) and not isinstance(inspect.getattr_static(cls, name, None),
                                                                    staticmethod):
            # Ray's ActorClass is an instance of a subclass of the user's class, so a method
            # read through it comes back bound. The same here: then cloudpickle, which pickles
            # a function by reference when ``module.Cls.method`` is that very function, pickles
            # the methods of an actor class of an installed module by value, and the actor's
            # process does not import that module to build it (SkyRL's registry actor would
            # otherwise run its module's import-time registrations inside its own constructor,
            # and wait on itself).
            return types.MethodType(value, self)
        return value

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.__ray_actor_class__)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ArgumentMismatchError(f"actors cannot be instantiated directly: use '{self.__name__}.remote(...)' "
                                    f"instead of '{self.__name__}(...)'")


def _payload(cls: type, opts: Options, args: tuple, kwargs: dict) -> Any:
    from podium.worker.caller.client import prepare

    sync_only = not is_async_class(cls)
    groups = opts.concurrency_groups
    if groups is not None:  # (a method in a group the actor lacks: refused here, before it starts)
        check_method_groups(cls, groups)
    elif method_groups(cls):
        check_method_groups(cls, {})
    # An async actor always has its shell: its methods and async __init__ run on loops of its
    # own, never on the worker's I/O loop, which must stay free to answer (as in Ray).
    if groups is None and sync_only and opts.max_concurrency in (None, 1):
        cia = ClassWithInitArgs(cls, *args, **kwargs)
    else:
        cia = ClassWithInitArgs(ActorShell, cls, opts.max_concurrency, args, kwargs, groups)
    if opts.process_env:  # variables the agent sets itself: the worker sets these before building
        cia = ClassWithInitArgs(WithProcessEnv, dict(opts.process_env), cia.cls, cia.args, cia.kwargs)
    with by_value(cia, cls):
        return prepare(tuple(cia.construct_payload()))


def _attached_group(rt: Session, info: Any, owns: bool, detached: bool = False) -> Any:
    from podium.controller.group import WorkerGroup

    group = WorkerGroup(resource_pool=None, worker_handles=[], name_prefix=info.spec.name)
    rt.run(_build.connect(rt, group._members, [info]), timeout=60, what=f"connecting to actor {info.spec.name}")
    group._owns_workers = owns
    group.detached = detached  # the runtime's shutdown leaves a detached actor running
    rt.track_group(group)
    attached[info.id] = group
    return group


def start_actor(cls: type, opts: Options, args: tuple, kwargs: dict) -> ActorHandle:
    """Start one actor of ``cls`` with ``opts`` (see :class:`ActorClass`)."""
    rt = get_runtime()
    opts = captured(opts, os.environ)
    if opts.name is not None:
        wname = actor_worker_name(opts.name, opts.namespace)
        if opts.get_if_exists:
            with contextlib.suppress(NotFoundError):
                return get_actor(opts.name, opts.namespace)
    else:
        wname = f"{_PREFIX}{_class_name(cls)}-{secrets.token_hex(6)}"
    payload = _payload(cls, opts, args, kwargs)

    async def create() -> tuple[Any, str, str, int]:
        pg_id, bundle, own_pg = await reserve(rt, opts, wname)
        try:
            return await create_worker(rt, opts, wname, pg_id, bundle), own_pg, pg_id, bundle
        except BaseException:
            if own_pg:
                with contextlib.suppress(Exception):
                    await rt.scheduler.remove_placement_group(own_pg)
            raise

    try:
        info, own_pg, pg_id, bundle = rt.run(create(), timeout=2 * rt.placement_timeout + 30,
                                             what=f"starting actor {wname}")
    except AlreadyExistsError:
        raise AlreadyExistsError(f"an actor named {opts.name!r} already exists in namespace "
                                 f"{opts.namespace!r} (get_actor() finds it)") from None
    group = _attached_group(rt, info, owns=True, detached=opts.detached)
    if not opts.detached:  # Ray's lifetime: gone with the last handle
        group._life = _life.arm(rt, group.workers, group._gid, group._pg_ids, [own_pg] if own_pg else [])
    if opts.max_restarts:  # this process restarts it when it dies (podium.controller.remote.restarts)
        from podium.controller.remote.restarts import Restarter
        group._restarter = Restarter(rt, group, opts, wname, lambda: _payload(cls, opts, args, kwargs), own_pg,
                                     pg_id, bundle)
        group._restarter.watch()
    # The constructor runs while .remote() returns; the group's calls wait for it (gate). The
    # refs its arguments carry live until it ran: the actor has counted its borrows by then.
    keep = refs_inside((*args, *kwargs.values()))
    group._calls.gate = asyncio.run_coroutine_threadsafe(_construct_or_stop(rt, group, payload, own_pg, keep),
                                                         rt.loop)
    return ActorHandle(group, _class_name(cls), opts.name, opts.namespace, returns=method_returns(cls))


async def _construct_or_stop(rt: Session, group: Any, payload: Any, own_pg: str, keep: Any = None) -> None:
    """Build the actor; when its constructor fails, remove its worker (and own placement
    group) and raise the error, which every call made to it then fails with. (``keep``: the
    refs the constructor's arguments carry, alive until it ran.)"""
    try:
        await construct(group, payload)
    except BaseException:
        restarter = getattr(group, "_restarter", None)
        if restarter is not None:  # a constructor that fails the first time: dead, as in Ray
            restarter.stop()
        if group._life is not None:
            group._life.disarm()
        await remove(rt, group, own_pg)
        raise


def get_actor(name: str, namespace: str | None = None) -> ActorHandle:
    """The live actor called ``name`` (NotFoundError when there is none), from any controller."""
    namespace = namespace or DEFAULT_NAMESPACE
    rt = get_runtime()
    wname = actor_worker_name(name, namespace)
    info = rt.run(_running_worker(rt, wname), timeout=rt.placement_timeout + 90, what="get_actor")
    if info is None:
        raise NotFoundError(f"no live actor named {name!r} in namespace {namespace!r}")
    group = _attached_group(rt, info, owns=False)
    described = rt.run(described_once_read(group.workers[0].client), timeout=90, what="get_actor")
    declared = {n: (count, described.stream_buffers.get(n)) for n, count in described.method_returns.items()}
    return ActorHandle(group, described.class_name or "?", name, namespace, returns=returns_from(declared))


async def _running_worker(rt: Session, wname: str) -> Any:
    """The running worker of the actor ``wname``, or None; an actor that is restarting
    (``max_restarts``) is waited for, as Ray's ``get_actor`` finds it meanwhile."""
    from podium.controller.remote.actorcalls import restartable
    from podium.v1 import common_pb2

    deadline = time.monotonic() + rt.placement_timeout + 60
    while True:
        try:
            info = (await rt.scheduler.get_workers(names=[wname]))[0]
        except NotFoundError:
            return None
        if info.state == common_pb2.WORKER_RUNNING:
            return info
        ended = info.state in (common_pb2.WORKER_EXITED, common_pb2.WORKER_FAILED)
        coming = info.spec.max_restarts and (not ended or (not info.exit.requested and restartable(info)))
        if not coming or time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.05)


def _stop(rt: Session, group: Any, pg_id: str = "") -> None:
    """Remove the actor's worker (and ``pg_id``); its pending calls then fail with
    WorkerDiedError once its connection breaks (the scheduler has its exit record)."""
    restarter = getattr(group, "_restarter", None)
    if restarter is not None:
        restarter.stop()
        pg_id = restarter.own_pg  # a restart may have placed it in a new group of its own
    if group._life is not None:
        group._life.disarm()
    rt.run(remove(rt, group, pg_id), timeout=60, what="stopping an actor")
    group._calls.close()


def kill(actor: ActorHandle | WorkerHandle, *, no_restart: bool = True) -> None:
    """Stop ``actor`` now (also a detached or a looked-up one); its pending calls fail with
    WorkerDiedError and its own placement group is removed.

    A group's :class:`WorkerHandle` (what ``wg.workers`` holds) is accepted too, as Ray's
    ``ray.kill`` takes the actor handles of verl's groups: that one worker stops (a detached
    group's workers outlive their controller otherwise); its placement group stays."""
    rt = get_runtime()
    if isinstance(actor, WorkerHandle):
        rt.run(rt.scheduler.remove_workers([actor.worker_id]), timeout=60, what=f"killing worker {actor.name}")
        return
    if not isinstance(actor, ActorHandle):
        raise InvalidArgumentError(f"kill() takes an actor handle or a group's worker handle, "
                                   f"got {type(actor).__name__}")
    if not no_restart and actor._info.spec.max_restarts:
        # Ray's kill(no_restart=False): the process goes and the actor is restarted (by its
        # owner; one that is not this process treats the stop as a kill for good).
        restarter = getattr(actor._group, "_restarter", None)
        if restarter is not None:
            restarter.expect_kill = True
        rt.run(rt.scheduler.remove_workers([actor.worker.worker_id]), timeout=60, what="killing an actor")
        return
    spec = actor.worker.info.spec
    pg_id = spec.placement_group_id
    own = ""
    with contextlib.suppress(Exception):
        pg = rt.run(rt.scheduler.get_placement_group(pg_id), timeout=30, what="kill")
        own = pg_id if pg.name == spec.name else ""  # the group made for this actor
    _stop(rt, actor._group, own)
