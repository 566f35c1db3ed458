"""Ray's ``ray.util.collective`` on ``torch.distributed``, with the rendezvous through Podium.

``init_collective_group(world_size, rank, backend, group_name)`` in each member process:
rank 0 opens a store on its node's address (:class:`~podium.transport.authstore.StoreServer`,
which serves only holders of the group's fresh key) and publishes its address, the key and a
nonce of this attempt in a named Podium actor (``podium-collective:<group_name>``, the way
Ray keeps NCCL's unique id in a named actor); the other ranks read them there and connect.
The key reaches the ranks only through Podium's authenticated calls. A rank that finds an
address it cannot use (an earlier attempt's: its store gone, or a store that does not hold
the key) waits for the next attempt's nonce rather than failing or dialling it again; a
rank 0 whose rendezvous fails removes the actor. The group is a process group of
its own (``ProcessGroupGloo``, or ``ProcessGroupNCCL`` for backend "nccl" where CUDA is
available; "nccl" falls back to gloo on a machine without CUDA so CPU tests run the same
code), so several named groups coexist with the program's default ``torch.distributed``
group. Operations run on the caller's tensors in place and return once done, as Ray's do.
A group asked for with backend "nccl" connects at its first operation, as Ray's NCCL groups
do; a "gloo" group connects in ``init_collective_group``.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import time
from typing import Any

from podium.compat import ray  # the stand-in's functions themselves, not the ``ray`` package over them
from podium.compat.standin import get_node_ip_address
from podium.errors import UnimplementedError

__all__ = [
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "create_collective_group",
    "destroy_collective_group",
    "get_collective_group_size",
    "get_rank",
    "init_collective_group",
    "is_group_initialized",
    "recv",
    "send",
]

#: group name -> [process group (None until connected), rank, world size, (store client, its
#: server on rank 0 or None), rendezvous actor handle or None, backend]
_groups: dict[str, list] = {}
#: How long ranks wait for each other (Ray's default collective timeout is 30 minutes).
TIMEOUT_S = 1800.0


class Rendezvous:
    """The named actor that holds a group's store address until every rank has read it."""

    def __init__(self) -> None:
        self.address: tuple[str, int, str, str] | None = None

    def publish(self, host: str, port: int, key: str, nonce: str) -> None:
        """Rank 0's store address, its key and this attempt's nonce."""
        self.address = (host, port, key, nonce)

    def lookup(self) -> tuple[str, int, str, str] | None:
        """``(host, port, key, nonce)``, or None until rank 0 has published them."""
        return self.address


def _actor_name(group_name: str) -> str:
    return f"podium-collective:{group_name}"


def _rendezvous(group_name: str) -> Any:
    """The group's rendezvous actor: made by the first rank to ask, found by the rest."""

    from podium.errors import AlreadyExistsError

    try:
        return ray.remote(Rendezvous).options(name=_actor_name(group_name), get_if_exists=True,
                                              num_cpus=0.01).remote()
    except AlreadyExistsError:  # another rank is starting it: wait until it runs
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                return ray.get_actor(_actor_name(group_name))
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _backend(backend: str) -> str:
    import torch

    name = str(getattr(backend, "value", backend)).lower()
    if name not in ("nccl", "gloo"):
        raise UnimplementedError(f"ray.util.collective backend {backend!r} is not provided by Podium; "
                                  "on Podium use: 'gloo' (CPU) or 'nccl' (GPU)")
    return "nccl" if name == "nccl" and torch.cuda.is_available() else "gloo"


def init_collective_group(world_size: int, rank: int, backend: str = "nccl", group_name: str = "default") -> None:
    """Join the collective group ``group_name`` as ``rank`` of ``world_size`` (every rank calls it).

    As Ray's NCCL groups, a group asked for with backend "nccl" connects at its first operation,
    so this returns before the other ranks have called it (verl initializes one worker group's
    side, then the other's); a "gloo" group connects here."""
    from podium.errors import AlreadyExistsError, InvalidArgumentError

    if group_name in _groups:
        raise AlreadyExistsError(f"collective group {group_name!r} is already initialized in this process")
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} is not in [0, {world_size})")
    entry = [None, rank, world_size, None, None, _backend(backend)]
    _groups[group_name] = entry
    if str(getattr(backend, "value", backend)).lower() != "nccl":
        try:
            _connect(group_name, entry)
        except BaseException:
            _groups.pop(group_name, None)
            raise


def _connect(group_name: str, entry: list) -> None:
    """Rendezvous with the group's other ranks and build its process group (fills ``entry``)."""
    import torch.distributed as dist

    from podium.transport.authstore import StoreClient, StoreServer, new_key

    _, rank, world_size, _, _, chosen = entry
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    actor: Any = _rendezvous(group_name) if world_size > 1 else None
    server = None
    try:
        if rank == 0:
            host, key = get_node_ip_address(), new_key()
            server = StoreServer(host, key)
            store = StoreClient(host, server.port, key, TIMEOUT_S)
            if actor is not None:
                ray.get(actor.publish.remote(host, server.port, key, secrets.token_hex(16)))
        else:
            store = _join(group_name, actor)
        prefixed = dist.PrefixStore(f"podium-collective/{group_name}/", store)
        if chosen == "nccl":
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        group.barrier().wait()  # every rank is connected: the rendezvous actor is no longer needed
    except BaseException:
        if server is not None:
            server.close()
        if rank == 0 and actor is not None:  # a later attempt starts from a fresh actor
            with contextlib.suppress(Exception):
                ray.kill(actor)
        raise
    # The store stays for the group's life: NCCL makes communicators through it lazily.
    entry[0], entry[3], entry[4] = group, (store, server), actor
    if rank == 0 and actor is not None:
        ray.kill(actor)


def _join(group_name: str, actor: Any) -> Any:
    """A connection to rank 0's store, from the newest attempt it published."""
    from podium.errors import DeadlineExceededError
    from podium.transport.authstore import StoreClient

    deadline = time.monotonic() + TIMEOUT_S
    stale: set[str] = set()  # nonces of attempts whose store could not be used
    last = ""
    while True:
        address = ray.get(actor.lookup.remote())
        if address is not None and address[3] not in stale:
            host, port, key, nonce = address
            try:
                return StoreClient(host, port, key, TIMEOUT_S)
            except OSError as exc:  # an earlier attempt's address: wait for rank 0's next one
                stale.add(nonce)
                last = f"; rank 0's last address {host}:{port} failed: {exc}"
        if time.monotonic() > deadline:
            raise DeadlineExceededError(f"rank 0 of collective group {group_name!r} did not publish a usable "
                                        f"address within {TIMEOUT_S:g} s: did every rank call "
                                        f"init_collective_group and use the group?{last}")
        time.sleep(0.05)


def create_collective_group(actors: list, world_size: int, ranks: list[int], backend: str = "nccl",
                            group_name: str = "default") -> None:
    """Ray's declarative form (the driver names the actors): not provided."""
    raise UnimplementedError("ray.util.collective.create_collective_group is not provided by Podium; on Podium "
                              "use: call init_collective_group(world_size, rank, backend, group_name) in each actor")


def _get(group_name: str) -> list:
    """The group's entry, connected (its first operation connects an "nccl" group)."""
    from podium.errors import NotFoundError

    try:
        entry = _groups[group_name]
    except KeyError:
        raise NotFoundError(f"collective group {group_name!r} is not initialized in this process "
                            "(call init_collective_group first)") from None
    if entry[0] is None:
        _connect(group_name, entry)
    return entry


def is_group_initialized(group_name: str = "default") -> bool:
    """True once this process joined ``group_name``."""
    return group_name in _groups


def get_rank(group_name: str = "default") -> int:
    """This process's rank in the group (-1 when it is not a member, as Ray)."""
    return _groups[group_name][1] if group_name in _groups else -1


def get_collective_group_size(group_name: str = "default") -> int:
    """The group's world size (-1 when this process is not a member, as Ray)."""
    return _groups[group_name][2] if group_name in _groups else -1


def destroy_collective_group(group_name: str = "default") -> None:
    """Leave the group and free its connections."""
    entry = _groups.pop(group_name, None)
    if entry is not None and entry[0] is not None:
        shutdown = getattr(entry[0], "shutdown", None)
        if shutdown is not None:
            shutdown()
    if entry is not None and entry[3] is not None:
        store, server = entry[3]
        store.close()
        if server is not None:
            server.close()


def broadcast(tensor: Any, src_rank: int = 0, group_name: str = "default") -> None:
    """Copy ``tensor`` of ``src_rank`` into every rank's ``tensor``."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = src_rank
    _get(group_name)[0].broadcast([tensor], opts).wait()


_OPS = {"SUM": "SUM", "PRODUCT": "PRODUCT", "MIN": "MIN", "MAX": "MAX"}


def allreduce(tensor: Any, group_name: str = "default", op: Any = "SUM") -> None:
    """Reduce ``tensor`` over the group (SUM, PRODUCT, MIN, MAX) into every rank's ``tensor``."""
    import torch.distributed as dist

    name = str(getattr(op, "name", op)).upper()
    if name not in _OPS:
        raise UnimplementedError(f"ray.util.collective reduce op {op!r} is not provided by Podium; "
                                  f"on Podium use: one of {sorted(_OPS)}")
    opts = dist.AllreduceOptions()
    opts.reduceOp = getattr(dist.ReduceOp, name)
    _get(group_name)[0].allreduce([tensor], opts).wait()


def allgather(tensor_list: list, tensor: Any, group_name: str = "default") -> None:
    """Every rank's ``tensor`` into ``tensor_list`` (one tensor per rank)."""
    _get(group_name)[0].allgather([tensor_list], [tensor]).wait()


def barrier(group_name: str = "default") -> None:
    """Return once every rank of the group reached it."""
    _get(group_name)[0].barrier().wait()


def send(tensor: Any, dst_rank: int, group_name: str = "default") -> None:
    """Send ``tensor`` to ``dst_rank``."""
    _get(group_name)[0].send([tensor], dst_rank, 0).wait()


def recv(tensor: Any, src_rank: int, group_name: str = "default") -> None:
    """Receive into ``tensor`` from ``src_rank``."""
    _get(group_name)[0].recv([tensor], src_rank, 0).wait()
