"""``Worker``: the base class of every object a Podium worker process hosts.

Compatible with ``verl.single_controller.base.worker.Worker``: the node agent
starts each worker process with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``,
``CUDA_VISIBLE_DEVICES``, ``WG_PREFIX``, ``WG_BACKEND=podium``,
``PODIUM_LOCAL_WORLD_SIZE`` (also as ``RAY_LOCAL_WORLD_SIZE``),
``PODIUM_WORKER_ID`` and ``PODIUM_NODE_ADDRESS``; ``Worker.__init__`` reads them
exactly as verl does, so ``torch.distributed.init_process_group()`` works unchanged.

Differences from verl, all where verl would fail:

* A subclass that never calls ``super().__init__()`` still has working mesh
  tables and ``fused_worker_dict``, and ``rank``/``world_size`` fall back to the
  environment.
* ``WorkerHelper._get_node_ip()`` works without Ray (``PODIUM_NODE_ADDRESS``, or
  the address the host routes from).
* ``RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES`` is not consulted: the node agent
  always sets ``CUDA_VISIBLE_DEVICES`` to exactly the bundle's GPU.
* ``create_transferqueue_client`` (TransferQueue only) is not provided.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from podium.errors import InvalidArgumentAssertion, InvalidArgumentError
from podium.worker.decorator import Dispatch, Execute, register

__all__ = ["DistRankInfo", "DistGlobalInfo", "WorkerHelper", "Worker"]


@dataclass
class DistRankInfo:
    """Ranks of this process in each parallel dimension (kept for verl imports)."""

    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int


@dataclass
class DistGlobalInfo:
    """Sizes of each parallel dimension (kept for verl imports)."""

    tp_size: int
    dp_size: int
    pp_size: int
    cp_size: int


def _host_of(address: str) -> str:
    """The host part of ``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    address = address.strip()
    if address.startswith("["):
        return address[1:address.index("]")] if "]" in address else address.strip("[")
    if address.count(":") == 1:
        host, port = address.split(":")
        if port.isdigit():
            return host
    return address


class WorkerHelper:
    """Address helpers a rank-0 worker uses to offer a rendezvous (verl's)."""

    @staticmethod
    def _get_node_ip() -> str:
        """This node's address: ``MY_HOST_IP``/``MY_HOST_IPV6`` if set, else
        ``PODIUM_NODE_ADDRESS`` under ``WG_BACKEND=podium`` or ``ray`` (a Podium worker, as the
        stand-in's ``ray.util.get_node_ip_address`` answers), else the address this host routes
        from."""
        by_env = os.getenv("MY_HOST_IP") or os.getenv("MY_HOST_IPV6")
        if by_env:
            return by_env
        backend = os.getenv("WG_BACKEND")
        node_address = os.getenv("PODIUM_NODE_ADDRESS")
        if backend in ("podium", "ray") and node_address:
            # Under ``podium run`` the stand-in's ``ray.util.get_node_ip_address`` answers this
            # same variable; the worker layer does not import ``ray`` (the layer above it).
            return _host_of(node_address)
        return _routable_ip()

    @staticmethod
    def _get_free_port() -> int:
        """A TCP port that was free a moment ago (it can be taken before use)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    @staticmethod
    def get_available_master_addr_port() -> tuple[str, str]:
        """``(node ip without brackets, free port as str)`` for MASTER_ADDR/PORT."""
        return WorkerHelper._get_node_ip().strip("[]"), str(WorkerHelper._get_free_port())

    @staticmethod
    def get_availale_master_addr_port() -> tuple[str, str]:
        """Deprecated misspelling kept because verl still has it."""
        return WorkerHelper.get_available_master_addr_port()

    @staticmethod
    def _get_pid() -> int:
        """This process's id."""
        return os.getpid()


def _routable_ip() -> str:
    # Connecting a UDP socket sends nothing; it only asks the kernel which
    # source address it would use, which is the address peers can reach.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            return sock.getsockname()[0]
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except KeyError:
        raise AttributeError(f"{name} is not set: this Worker was not started by a WorkerGroup "
                             f"and did not call Worker.__init__") from None


class Worker(WorkerHelper):
    """A rank of a WorkerGroup (verl's ``Worker``).

    Subclass it and mark methods with ``@register``; the WorkerGroup binds them.
    ``__init__`` reads the required env ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT`` (a missing one raises ``KeyError`` naming it) and the optional
    ``LOCAL_WORLD_SIZE`` (default 1) and ``LOCAL_RANK`` (default 0), writes them
    back to ``os.environ`` (``cuda_visible_devices`` overrides
    ``CUDA_VISIBLE_DEVICES``) and sets ``REDIS_STORE_SERVER_HOST``.
    ``create_transferqueue_client`` (TransferQueue) is deliberately omitted.
    """

    #: Name of the attribute that holds sibling roles when fused.
    fused_worker_attr_name = "fused_worker_dict"
    # Set per instance from the environment at construction (see ``_configure_with_store``);
    # declared here for the type checker.
    _master_addr: str
    _master_port: str

    @classmethod
    def env_keys(cls) -> list[str]:
        """The environment variables that configure a Worker."""
        return ["WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "CUDA_VISIBLE_DEVICES"]

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        self._setup_env_cuda_visible_devices()
        world_size = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        self._rank = rank
        self._world_size = world_size
        master_addr = os.environ["MASTER_ADDR"]
        master_port = os.environ["MASTER_PORT"]
        local_world_size = int(os.getenv("LOCAL_WORLD_SIZE", "1"))
        local_rank = int(os.getenv("LOCAL_RANK", "0"))
        store: dict[str, Any] = {
            "_world_size": world_size,
            "_rank": rank,
            "_local_world_size": local_world_size,
            "_local_rank": local_rank,
            "_master_addr": master_addr,
            "_master_port": master_port,
        }
        if cuda_visible_devices is not None:
            store["_cuda_visible_devices"] = cuda_visible_devices
        self._configure_with_store(store)
        self.fused_worker_dict: dict[str, Any] = {}
        self.__dispatch_dp_rank: dict[str, int] = {}
        self.__collect_dp_rank: dict[str, bool] = {}

    # ------------------------------------------------------------------ env

    def _setup_env_cuda_visible_devices(self) -> None:
        """Fold ``HIP_VISIBLE_DEVICES``/``ROCR_VISIBLE_DEVICES`` into ``CUDA_VISIBLE_DEVICES``.

        HIP must agree with CUDA when both are set (AssertionError, as verl);
        ROCR together with CUDA or HIP is a ValueError (their meanings differ).
        """
        rocr_val = os.environ.get("ROCR_VISIBLE_DEVICES")
        hip_val = os.environ.get("HIP_VISIBLE_DEVICES")
        cuda_val = os.environ.get("CUDA_VISIBLE_DEVICES")
        if hip_val:
            val = os.environ.pop("HIP_VISIBLE_DEVICES")
            if cuda_val:
                if val != cuda_val:
                    raise InvalidArgumentAssertion(
                        f"Please use the same HIP_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES, "
                        f"inconsistent values found: {val} and {cuda_val}.")
            else:
                cuda_val = val
                os.environ["CUDA_VISIBLE_DEVICES"] = val
        if rocr_val:
            if cuda_val:
                raise InvalidArgumentError("Please don't set ROCR_VISIBLE_DEVICES when HIP/CUDA_VISIBLE_DEVICES is set.")
            os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.pop("ROCR_VISIBLE_DEVICES")

    def _configure_with_store(self, store: dict[str, Any]) -> None:
        """Set ``self._<key>`` for every env key and write the non-None ones to os.environ."""
        values = {f"_{key.lower()}": store.get(f"_{key.lower()}") for key in type(self).env_keys()}
        self.__dict__.update(values)
        for key in type(self).env_keys():
            val = values[f"_{key.lower()}"]
            if val is not None:
                os.environ[key] = str(val)
        master_addr = self.__dict__.get("_master_addr")
        os.environ["REDIS_STORE_SERVER_HOST"] = (
            str(master_addr).replace("[", "").replace("]", "") if master_addr else "")

    def get_master_addr_port(self) -> tuple[str, str]:
        """``(MASTER_ADDR, MASTER_PORT)`` as read at construction."""
        return self._master_addr, self._master_port

    def get_cuda_visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES``, or ``"not set"``."""
        return os.environ.get("CUDA_VISIBLE_DEVICES", "not set")

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        try:
            return self._world_size
        except AttributeError:
            return _env_int("WORLD_SIZE")

    @property
    def rank(self) -> int:
        """This worker's rank in the group."""
        try:
            return self._rank
        except AttributeError:
            return _env_int("RANK")

    # ------------------------------------------------------------------ fused roles

    def get_fused_worker_by_name(self, worker_name: str) -> Any:
        """The sibling role called ``worker_name`` when fused, else None."""
        return getattr(self, "fused_worker_dict", {}).get(worker_name)

    # ------------------------------------------------------------------ mesh info

    def _mesh_tables(self) -> tuple[dict[str, int], dict[str, bool]]:
        # Created on first use so that subclasses skipping __init__ still work.
        try:
            return self.__dispatch_dp_rank, self.__collect_dp_rank
        except AttributeError:
            self.__dispatch_dp_rank = {}
            self.__collect_dp_rank = {}
            return self.__dispatch_dp_rank, self.__collect_dp_rank

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Record this rank's DP rank and collect flag for ``mesh_name`` (mesh dispatch).

        Raises ValueError when ``mesh_name`` was registered before.
        """
        dispatch, collect = self._mesh_tables()
        if mesh_name in dispatch or mesh_name in collect:
            raise InvalidArgumentError(f"mesh_name {mesh_name} has been registered")
        dispatch[mesh_name] = dp_rank
        collect[mesh_name] = is_collect

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        """This rank's DP rank in ``mesh_name`` (AssertionError if unknown)."""
        dispatch, _ = self._mesh_tables()
        if mesh_name not in dispatch:  # explicit: must hold under python -O too
            raise InvalidArgumentAssertion(f"{mesh_name} is not registered in {type(self).__name__}")
        return dispatch[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank's output is collected for ``mesh_name``."""
        return self.query_collect_info(mesh_name)

    def query_collect_info(self, mesh_name: str) -> bool:
        """Unregistered twin of ``_query_collect_info`` (AssertionError if unknown)."""
        _, collect = self._mesh_tables()
        if mesh_name not in collect:
            raise InvalidArgumentAssertion(f"{mesh_name} is not registered in {type(self).__name__}")
        return collect[mesh_name]

    def get_dispatch_collect(self) -> dict[str, dict]:
        """``{"dispatch_dp_rank": {mesh: int}, "collect_dp_rank": {mesh: bool}}`` (live dicts)."""
        dispatch, collect = self._mesh_tables()
        return {"dispatch_dp_rank": dispatch, "collect_dp_rank": collect}

    def set_dispatch_collect(self, mesh_name: str, dispatch_dp_rank: dict[str, int],
                             collect_dp_rank: dict[str, bool]) -> None:
        """Re-export another worker's mesh info under ``mesh_name``.

        As verl, the *last* value of each dict is copied (the inner engine is
        expected to have one mesh); AssertionError if ``mesh_name`` exists.
        """
        dispatch, collect = self._mesh_tables()
        if mesh_name in dispatch or mesh_name in collect:
            raise InvalidArgumentAssertion(f"{mesh_name} is already registered in dispatch/collect info")
        for dp_rank in dispatch_dp_rank.values():
            dispatch[mesh_name] = dp_rank
        for is_collect in collect_dp_rank.values():
            collect[mesh_name] = is_collect

    # ------------------------------------------------------------------ driver functions

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a driver-defined ``func(self, *args, **kwargs)`` on every rank's shard."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a driver-defined ``func(*args, **kwargs)`` on rank 0 only."""
        return func(*args, **kwargs)
