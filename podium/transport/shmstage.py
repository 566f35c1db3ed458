"""One shared-memory segment for a whole group call: the batch written once, each same-host
rank given references to its rows.

A ``DP_COMPUTE_PROTO`` call sends each rank a shard of one batch. Written rank by rank into
each connection's own pooled segment (:mod:`podium.transport.shmpool`), the shards land in N
segments, and results computed in place come back as N separate pieces that the controller
must copy together again. Staged instead, every large buffer of the call's same-host payloads
is copied once into one segment, laid out as the buffers lay in the caller's memory, so rank
i's rows of a tensor sit right after rank i-1's, as they did in the batch. Each rank is sent
references (buffer index, offset, length) into it; a result computed in place comes back as
references into the same segment (``SyncInvoker.package``), and concatenating the ranks' rows
is then a view of that segment (:mod:`podium.rowcat`), not a copy. A ``ONE_TO_ALL`` argument,
the same buffers for every rank, is copied once rather than once per rank.

Several workers map a staged segment, so, unlike a pooled one, no reader unlinks it: it stays a
file until this process drops it (a crashed controller's are removed by the node agent's sweep
of dead creators, :func:`podium.transport.shm.cleanup_stale`). It is written again for a later
call only once every worker it was sent to has released it (``shm_released`` on its
connection), no call that carries it is still in flight or being sent (pins), and no value
here views it.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from podium import codec, spans
from podium.errors import DataLossError
from podium.memorypool import move
from podium.transport import shm, shmsegment

__all__ = ["Staged", "StageLink", "StagePool", "STAGE"]

# Free staged segments kept for the next call; more are dropped.
_MAX_FREE = 2
# Buffers placed so that their address modulo this is what it was in the caller's memory
# (a dtype's alignment is kept, even for a slice that started at an odd address).
_ALIGN = 64


class Staged:
    """A payload's large buffers as references into staged segment ``name``: ``refs`` is flat
    (buffer index, offset, length) triples; ``rest`` the payload without those buffers."""

    __slots__ = ("name", "refs", "rest", "nbytes")

    def __init__(self, name: str, refs: list[int], rest: codec.Encoded) -> None:
        self.name = name
        self.refs = refs
        self.rest = rest
        self.nbytes = rest.nbytes


class StageLink(Protocol):
    """A connection a staged segment was sent on, as this module sees it (a
    :class:`~podium.transport.sharedsegments.SharedSegments`): told when the peer must let go
    of a segment that is gone."""

    def forget_foreign(self, names: Sequence[str]) -> None:
        """Tell the peer to forget ``names`` (safe on any thread)."""


class _Stage:
    __slots__ = ("name", "size", "mapping", "base", "holders", "pins", "views", "links", "dropped")

    def __init__(self, name: str, size: int, mapping: Any) -> None:
        self.name = name
        self.size = size
        self.mapping = mapping
        self.base = shmsegment.address_of(mapping)
        #: Connections whose worker was sent it and has not released it: how many times.
        self.holders: dict[StageLink, int] = {}
        self.pins = 0  # calls being sent or in flight
        self.views = 0  # values of this process that view it
        self.links: weakref.WeakSet[StageLink] = weakref.WeakSet()  # connections that were ever sent it
        self.dropped = False

    @property
    def in_use(self) -> bool:
        return bool(self.holders) or self.pins > 0 or self.views > 0

    def let_go(self, link: StageLink) -> None:
        count = self.holders.get(link, 0)
        if count > 1:
            self.holders[link] = count - 1
        else:
            self.holders.pop(link, None)


class StagePool:
    """This process's staged segments (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        # Re-entrant: a view's finalizer may run inside any allocation made under the lock.
        self._lock = threading.RLock()
        self._free: list[_Stage] = []
        self._used: dict[str, _Stage] = {}

    @property
    def in_use(self) -> int:
        """Staged segments in use now (sent, pinned or viewed)."""
        with self._lock:
            return len(self._used)

    @property
    def segments(self) -> int:
        """Staged segments held now, free or in use."""
        with self._lock:
            return len(self._used) + len(self._free)

    def stage(self, payloads: Sequence[Any], min_bytes: int) -> str | None:
        """Copy the buffers of at least ``min_bytes`` of ``payloads`` (each a
        :class:`~podium.transport.payload.Payload`) once into one segment and set each
        payload's ``staged`` to its references. Returns the segment's name, pinned once for
        the caller (:meth:`unpin` it when every call that carries it has been sent), or None
        when nothing is large enough or there is no room (the payloads then go as before).
        Run it off the event loop: it copies the batch. Raises OSError when ``/dev/shm``
        cannot hold a new segment.
        """
        found = []  # (address, nbytes, payload index, buffer index)
        for p_index, payload in enumerate(payloads):
            for b_index, buf in enumerate(payload.encoded.buffers):
                if buf.nbytes >= min_bytes:
                    address = shmsegment.address_of(buf)
                    if address:
                        found.append((address, buf.nbytes, p_index, b_index))
        if not found:
            return None
        found.sort()
        # Extents of the caller's memory, overlapping or touching buffers merged: rows of one
        # tensor sent to several ranks stay one run of bytes.
        extents: list[list[int]] = []  # [start, end, offset in the segment]
        cursor = 0  # where the segment's laid-out bytes end
        for address, nbytes, _, _ in found:
            if extents and address <= extents[-1][1]:
                grow = address + nbytes - extents[-1][1]
                if grow > 0:
                    extents[-1][1] += grow
                    cursor += grow
                continue
            offset = cursor + (address - cursor) % _ALIGN
            extents.append([address, address + nbytes, offset])
            cursor = offset + nbytes
        stage = self._take(cursor)
        if stage is None:
            return None
        try:
            move([(stage.base + offset, start, end - start) for start, end, offset in extents])
        except BaseException:
            with self._lock:
                self._used.pop(stage.name, None)
            self._drop(stage)
            raise
        placed: dict[int, list[tuple[int, int, int]]] = {}
        which = 0
        for address, nbytes, p_index, b_index in found:
            while address >= extents[which][1]:
                which += 1
            start, _, offset = extents[which]
            placed.setdefault(p_index, []).append((b_index, offset + address - start, nbytes))
        for p_index, refs in placed.items():
            payload = payloads[p_index]
            rest = codec.without_buffers(payload.encoded, {b for b, _, _ in refs})
            payload.staged = Staged(stage.name, [n for ref in sorted(refs) for n in ref], rest)
        return stage.name

    def _take(self, nbytes: int) -> _Stage | None:
        with self._lock:
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                stage = min(fits, key=lambda s: s.size)
                self._free.remove(stage)
                stage.pins = 1
                self._used[stage.name] = stage
                return stage
        size = shmsegment.rounded(nbytes)
        if not shmsegment.budget.take(size):
            with self._lock:
                free, self._free = self._free, []
            for stage in free:
                self._drop(stage)
            if not shmsegment.budget.take(size):
                return None
        try:
            name, mapping = shmsegment.create_segment(size)
        except BaseException:
            shmsegment.budget.give(size)
            raise
        stage = _Stage(name, size, mapping)
        stage.pins = 1
        with self._lock:
            self._used[stage.name] = stage
        return stage

    def sent(self, name: str, link: StageLink) -> None:
        """A call carrying ``name`` is being sent on connection ``link``: pinned until :meth:`unpin`, and
        held for that worker until it releases it. Raises DataLossError if it was dropped."""
        with self._lock:
            stage = self._used.get(name)
            if stage is None or stage.dropped:
                raise DataLossError(f"staged segment {name} was dropped before its call was sent")
            stage.pins += 1
            stage.holders[link] = stage.holders.get(link, 0) + 1
            stage.links.add(link)

    def unpin(self, name: str) -> None:
        """A pin of :meth:`stage` or :meth:`sent` ends (the call's reply is decoded, or it failed)."""
        with self._lock:
            stage = self._used.get(name)
            if stage is not None and stage.pins > 0:
                stage.pins -= 1
                self._settle_locked(stage)

    def release(self, name: str, link: StageLink) -> bool:
        """The worker on connection ``link`` is done with ``name``; False if not staged here."""
        with self._lock:
            stage = self._used.get(name)
            if stage is None:
                return False
            stage.let_go(link)
            self._settle_locked(stage)
            return True

    def link_closed(self, link: StageLink) -> None:
        """Connection ``link`` ended: its worker holds nothing of this process's any more."""
        with self._lock:
            for stage in list(self._used.values()):
                if stage.holders.pop(link, None) is not None:
                    self._settle_locked(stage)

    def abandon(self, name: str, link: StageLink | None) -> None:
        """A call that carried ``name`` failed or went away: its worker may never release it,
        so the segment is never written again. Its file goes now; the other ranks' replies
        may still view it, and it is unmapped once nothing uses it. Ends the call's pin."""
        with self._lock:
            stage = self._used.get(name)
            if stage is None:
                return
            if not stage.dropped:
                stage.dropped = True
                self._retire(stage)
            stage.pins = max(0, stage.pins - 1)
            if link is not None:
                stage.let_go(link)
            self._settle_locked(stage)

    def view(self, name: str, offset: int, length: int) -> memoryview:
        """A writable view of bytes of staged segment ``name`` (a reply written in place), which
        keeps it from reuse while it, or anything decoded from it, lives. DataLossError for a
        segment not in use here or a range outside it."""
        with self._lock:
            stage = self._used.get(name)
            if stage is None or not (stage.holders or stage.pins):
                raise DataLossError(f"a reply refers to segment {name}, which this side has not "
                                    "lent to the peer")
            return self._view_locked(stage, offset, length)

    def span(self, address: int, nbytes: int) -> memoryview | None:
        """A view of ``nbytes`` at ``address`` if they lie in one staged segment in use (rows
        of several ranks' results, adjacent there), else None."""
        with self._lock:
            for stage in self._used.values():
                if stage.base <= address and address + nbytes <= stage.base + stage.size:
                    return self._view_locked(stage, address - stage.base, nbytes)
        return None

    def _view_locked(self, stage: _Stage, offset: int, length: int) -> memoryview:
        view = shmsegment.lent_view(stage.mapping, stage.size, stage.name, offset, length, self._unview, stage)
        stage.views += 1
        return view

    def _unview(self, stage: _Stage) -> None:
        with self._lock:
            stage.views -= 1
            if self._used.get(stage.name) is stage:
                self._settle_locked(stage)

    def _settle_locked(self, stage: _Stage) -> None:
        if stage.in_use:
            return
        del self._used[stage.name]
        if stage.dropped:
            shmsegment.drop_segment(stage.name, stage.size, stage.mapping)
            return
        self._free.append(stage)
        while len(self._free) > _MAX_FREE:
            self._drop(self._free.pop(0))  # the least recently used first

    def _retire(self, stage: _Stage) -> None:
        # No new reader may map it, and those that did let it go once unused.
        shm.remove_segment(stage.name)
        for link in list(stage.links):
            link.forget_foreign([stage.name])

    def _drop(self, stage: _Stage) -> None:
        stage.dropped = True
        self._retire(stage)
        shmsegment.drop_segment(stage.name, stage.size, stage.mapping)

    def close(self) -> None:
        """Drop every free staged segment and unlink those in use (their memory goes when
        their holders let go): at shutdown and at exit, so no file outlives this process."""
        with self._lock:
            free, self._free = self._free, []
            used = [stage for stage in self._used.values() if not stage.dropped]
            for stage in used:
                stage.dropped = True
        for stage in free:
            self._drop(stage)
        for stage in used:
            self._retire(stage)


#: The process's staged segments (a controller's; workers never stage).
STAGE = StagePool()
atexit.register(STAGE.close)
# Rows that came back adjacent in a staged segment concatenate into a view of it.
spans.register(STAGE.span)
