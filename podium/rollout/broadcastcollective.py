"""Weight broadcast over a process group of its own: NCCL between GPUs, gloo on CPUs.

The same shape as :mod:`podium.rollout.broadcast` (verl's checkpoint engine): the sender's
:meth:`CollectiveSender.prepare` opens the rendezvous (a :class:`~podium.transport.authstore.StoreServer`
on its node's address, which serves only holders of the group's key) and returns the metadata
every replica joins with: the metadata, key included, travels only in Podium's authenticated
calls; :meth:`CollectiveSender.send`
takes ``(name, tensor)`` pairs, :meth:`CollectiveReceiver.receive` gives them back once the
whole update arrived. Each bucket is one ``broadcast`` from rank 0 (the sender) to ranks
1..N (the replicas): on GPUs NCCL runs it at the interconnect's speed, tensors stay on the
device; on CPUs it is gloo over TCP. The bucket's manifest goes through the store, keyed by
update and record number (a bucket's, or the END record's; only key holders can write
one, so a rank acts only on records its sender wrote), so nothing is ever unpickled
and a replica allocates only what the manifest announces within the bounds of
:mod:`podium.rollout.weights.plan`.

The group lives as long as its sender and receivers (NCCL communicators are slow to make):
one :meth:`prepare` serves every later update with the same replicas. A replica that dies
breaks the group: the others fail their update (and keep their previous weights, since
nothing is handed over before the END record), and a new group must be prepared.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable
from typing import Any

from podium.errors import DataLossError, InvalidArgumentError, UnavailableError
from podium.rollout.weights.plan import (
    DEFAULT_BUCKET_BYTES,
    MAX_BUCKET_BYTES,
    MAX_MANIFEST_BYTES,
    aligned,
    carried_dtypes,
    check_bucket_bytes,
    check_timeout,
    tensor_views,
)

__all__ = ["CollectiveReceiver", "CollectiveSender"]


def _device(backend: str) -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _backend(backend: str) -> str:
    import torch

    if backend not in ("nccl", "gloo"):
        raise InvalidArgumentError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    return "nccl" if backend == "nccl" and torch.cuda.is_available() else "gloo"


def _group(store: Any, token: str, rank: int, size: int, backend: str, timeout: float) -> Any:
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"podium-weights/{token}/", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, size)
    return dist.ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=timeout))


def _broadcast(group: Any, tensor: Any) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class CollectiveSender:
    """Rank 0: opens the rendezvous, then broadcasts each update bucket by bucket."""

    def __init__(self, replicas: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = 120.0,
                 backend: str = "nccl", host: str | None = None) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 4096:
            raise InvalidArgumentError(f"replicas must be an int in [1, 4096], got {replicas!r}")
        self.replicas = replicas
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.timeout = check_timeout(timeout)
        self.backend = _backend(backend)
        self.host = host or os.environ.get("PODIUM_NODE_ADDRESS") or "127.0.0.1"
        self._server: Any = None  # a StoreServer, once prepared
        self._store: Any = None  # a StoreClient of it
        self._group: Any = None
        self._token = ""
        self._updates = 0
        #: Records written per update, so an update two back can be deleted (the store is bounded).
        self._written: dict[int, int] = {}

    def prepare(self) -> dict:
        """Open the rendezvous; the metadata each replica's :meth:`CollectiveReceiver.join` takes."""
        from podium.transport.authstore import StoreClient, StoreServer, new_key

        if self._store is None:
            self._token = new_key()
            self._server = StoreServer(self.host, self._token)
            self._store = StoreClient(self.host, self._server.port, self._token, self.timeout)
        assert self._server is not None
        return {"host": self.host, "port": self._server.port, "token": self._token,
                "world_size": self.replicas + 1, "backend": self.backend}

    @property
    def ready(self) -> bool:
        """Whether the rendezvous is open (False before :meth:`prepare` and once a failed update closed it)."""
        return self._store is not None

    def send(self, weights: Iterable[tuple[str, Any]], step: int | None = None) -> dict:
        """Broadcast every pair of ``weights`` (joining the group on the first update);
        ``{"tensors", "bytes", "buckets"}``."""
        import torch

        if self._store is None:
            raise InvalidArgumentError("weight broadcast: send before prepare")
        if self._group is None:  # waits for every replica to join (within the timeout)
            self._group = _group(self._store, self._token, 0, self.replicas + 1, self.backend, self.timeout)
        update = self._updates = self._updates + 1
        # Every replica read update - 2's records before it took part in update - 1's buckets.
        for index in range(self._written.pop(update - 2, 0)):
            self._store.delete_key(f"record/{update - 2}/{index}")
        device = _device(self.backend)
        dtypes = carried_dtypes()
        pending: list[tuple[str, Any]] = []
        size = tensors = total = buckets = 0
        try:
            for name, tensor in weights:
                if not isinstance(name, str) or not isinstance(tensor, torch.Tensor) or \
                        str(tensor.dtype).removeprefix("torch.") not in dtypes:
                    raise InvalidArgumentError(f"weights must be (str, torch.Tensor) pairs of a carried dtype, "
                                               f"got ({type(name).__name__}, {getattr(tensor, 'dtype', type(tensor))})")
                nbytes = tensor.numel() * tensor.element_size()
                if pending and size + aligned(nbytes) > self.bucket_bytes:
                    total += self._bucket(update, buckets, pending, size, device)
                    buckets += 1
                    pending, size = [], 0
                pending.append((name, tensor))
                size += aligned(nbytes)
                tensors += 1
            if pending:
                total += self._bucket(update, buckets, pending, size, device)
                buckets += 1
        except (RuntimeError, OSError) as exc:  # a replica gone: the group is broken
            self.close()
            raise UnavailableError(f"weight broadcast over {self.backend}: update {update} failed: {exc}") from None
        self._store.set(f"record/{update}/{buckets}", json.dumps({"end": True, "tensors": tensors, "bytes": total,
                                                                  "buckets": buckets, "step": step}))
        self._written[update] = buckets + 1
        return {"tensors": tensors, "bytes": total, "buckets": buckets}

    def _bucket(self, update: int, index: int, pending: list, size: int, device: Any) -> int:
        import torch

        assert self._store is not None
        entries, offset = [], 0
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        for name, tensor in pending:
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[offset:offset + flat.numel()].copy_(flat)
            entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, flat.numel()])
            offset = aligned(offset + flat.numel())
        self._store.set(f"record/{update}/{index}", json.dumps({"tensors": entries, "size": size}))
        _broadcast(self._group, buffer)
        return sum(entry[4] for entry in entries)

    def close(self) -> None:
        """Leave the group and close the rendezvous."""
        group, self._group = self._group, None
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()
        store, self._store, server, self._server = self._store, None, self._server, None
        if store is not None:
            store.close()
        if server is not None:
            server.close()


class CollectiveReceiver:
    """A replica (rank 1..N): joins the sender's group, then takes updates as they come."""

    def __init__(self, name: str = "", timeout: float = 120.0) -> None:
        self.name = name or f"pid {os.getpid()}"
        self.timeout = check_timeout(timeout)
        self._group: Any = None
        self._store: Any = None  # a StoreClient, once joined
        self._backend = "gloo"
        self._updates = 0

    def join(self, metadata: dict, rank: int) -> None:
        """Connect to the sender's rendezvous as ``rank`` (1..N) of its group."""
        from podium.transport.authstore import StoreClient

        try:
            host, port, token = str(metadata["host"]), int(metadata["port"]), str(metadata["token"])
            size, backend = int(metadata["world_size"]), str(metadata["backend"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"weight broadcast: metadata {metadata!r} is not a sender's") from exc
        if not 1 <= rank < size or backend not in ("nccl", "gloo"):
            raise InvalidArgumentError(f"weight broadcast: rank {rank} of {size} over {backend!r} is not a replica's")
        try:
            self._store = StoreClient(host, port, token, self.timeout)
            self._group = _group(self._store, token, rank, size, backend, self.timeout)
        except (RuntimeError, OSError, ValueError) as exc:
            raise UnavailableError(f"weight broadcast: replica {self.name} cannot join the group at "
                                   f"{host}:{port}: {exc}") from None
        self._backend = backend
        self._updates = 0

    @property
    def joined(self) -> bool:
        """Whether this receiver is in a group (False before :meth:`join` and once it broke)."""
        return self._group is not None

    def receive(self, step: int | None = None) -> list[tuple[str, Any]]:
        """The next update's ``(name, tensor)`` pairs (on the group's device), once it is whole."""
        import torch

        if self._group is None or self._store is None:
            raise InvalidArgumentError("weight broadcast: receive before join")
        update = self._updates = self._updates + 1
        device = _device(self._backend)
        dtypes = carried_dtypes()
        items: list[tuple[str, Any]] = []
        index = total = 0
        try:
            while True:
                # A bucket's manifest, or the END record: the store's get waits for it.
                raw = self._store.get(f"record/{update}/{index}")
                if len(raw) > MAX_MANIFEST_BYTES:
                    raise DataLossError(f"weight broadcast: a manifest of {len(raw)} bytes is over the bound")
                try:
                    record = json.loads(raw)
                except ValueError:
                    record = None
                if not isinstance(record, dict):
                    raise DataLossError("weight broadcast: a record that is not an object")
                if record.get("end") is True:
                    break
                size = record.get("size")
                if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_BUCKET_BYTES:
                    raise DataLossError(f"weight broadcast: a bucket of {size!r} bytes is out of bounds")
                buffer = torch.empty(size, dtype=torch.uint8, device=device)
                _broadcast(self._group, buffer)
                total += tensor_views(buffer, record.get("tensors"), dtypes, items, "the sender")
                index += 1
        except (RuntimeError, OSError) as exc:  # the sender or another replica gone, or silent too long
            self._group = None
            raise UnavailableError(f"weight broadcast: replica {self.name} lost the group mid-update: {exc}") from None
        if record.get("tensors") != len(items) or record.get("bytes") != total:
            raise DataLossError(f"weight broadcast: the sender announced {record.get('tensors')} tensors / "
                                f"{record.get('bytes')} bytes, replica {self.name} got {len(items)} / {total}")
        if step is not None and record.get("step") != step:
            raise DataLossError(f"weight broadcast: update of step {record.get('step')}, replica {self.name} "
                                f"expected {step}")
        return items
