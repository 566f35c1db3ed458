"""Running a synchronous method and packaging what it returned: the execution thread's
one way to run a call, whoever read it (the loop's fast path, its general path, or the
thread reading the socket itself, :mod:`podium.worker.host.directcalls`)."""

from __future__ import annotations

import functools
from typing import Any

from podium import codec, refs
from podium.memorypool import MIN_POOLED_BYTES
from podium.tracering import RING, now_ns
from podium.transport.connection import CallConnection
from podium.transport.shmpool import REF_MIN_BYTES
from podium.v1 import worker_pb2
from podium.worker.host.config import FETCH_CALL, HostConfig
from podium.worker.host.heldstore import HeldStore
from podium.worker.host.results import (ENCODED_NONE, IMMUTABLE_RESULTS, NONE_OUTCOME, FrozenResult, LentReply,
                                        Outcome, call_error, reply_snapshot)

__all__ = ["SyncInvoker"]


class SyncInvoker:
    """Runs a host's sync methods and turns their values into :class:`Outcome` replies
    (held, in shared memory, lent, or copied for the socket)."""

    def __init__(self, config: HostConfig, held: HeldStore, stats: dict) -> None:
        self._config = config
        self._held = held
        self._stats = stats
        #: "host:port" of the host (a held result's owner address; set once bound).
        self.address = ""
        # The commonest call returns None and asks for no held result or shared memory: its
        # outcome needs no look at the value (see package).
        self._none_in_shm = NONE_OUTCOME.nbytes >= config.shm_threshold_bytes

    def invoke(self, fn: Any, args: list, kwargs: dict, header: worker_pb2.CallHeader,
               conn: CallConnection | None) -> Outcome:
        """Run a sync method and package its value (on the execution thread); its exception
        is raised as the call's error."""
        started = now_ns() if RING.on else 0
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - user code; reported, worker keeps serving
            if started:
                RING.add("run", header.method, started, now_ns(), header.trace_id, ok=False)
            raise call_error(fn, args, kwargs, exc, self._config.rank, self._config.node_address) from None
        if started:
            RING.add("run", header.method, started, now_ns(), header.trace_id)
        return self.package(value, header, conn, settle_later=True)

    def package(self, value: Any, header: worker_pb2.CallHeader,
                conn: CallConnection | None = None, settle_later: bool = False) -> Outcome:
        """Encode a result and hold it, put it in shared memory for the caller (``conn``'s
        segments when it has room, else a one-shot segment), or ready it for streaming.

        A result whose large buffers lie in the call's own argument segment (a method that
        changed its batch in place and returned it) is sent as references into that segment,
        which the caller owns, instead of a copy, when the method kept no view of its
        argument: then nothing here can change those bytes any more, so the caller's value
        is a snapshot, as a copy would be. Whether it kept one is known only once the call's
        arguments are dropped; with ``settle_later`` (the execution thread) the decision is
        left to ``Outcome.settle`` at that point, else it is made now. On the execution
        thread a large reply going out as a TCP bulk frame is lent, not copied (``LentReply``).
        """
        if value is None and not header.hold_result and not (header.reply_in_shm and self._none_in_shm):
            return NONE_OUTCOME  # most methods return None
        if value is None:
            encoded = ENCODED_NONE
        else:
            with refs.exporting():  # refs this process owns, inside it, outlive the method
                encoded = codec.encode(value)
        nbytes = encoded.nbytes
        if header.hold_result:
            rows = refs.rows_of(value)
            self._held.check_room(nbytes)
            frozen = FrozenResult(encoded.to_segments(), nbytes)
            # The held value is a snapshot (decoded from the frozen copy) unless nothing can
            # change it anyway (None, numbers, strings: most small results).
            snapshot = value if type(value) in IMMUTABLE_RESULTS else codec.decode(frozen.buffer)
            held = self._held.put(snapshot, frozen, nbytes, rows)
            return Outcome(ref=worker_pb2.ObjectRefInfo(
                object_id=held.object_id, worker_id=self._config.worker_id,
                owner_address=self.address, owner_rank=self._config.rank,
                size_bytes=nbytes, rows=rows,
                # Small results ride along, so the caller's get() needs no Fetch.
                inline_value=bytes(frozen.buffer) if nbytes <= self._config.inline_result_bytes else b""))
        # The socket reads a reply later: copy it now, unless it is a held result (a frozen
        # snapshot already) going out to a fetch.
        snapshot = value is not None and type(value) not in IMMUTABLE_RESULTS and header.method != FETCH_CALL
        argument = header.refs_segment or (header.shm_name if header.shm_pooled else "")
        # A staged argument's rows are references whatever their size (the group call as a
        # whole was large enough to stage); a pooled one only reaches here above the threshold.
        if (snapshot and header.reply_in_shm and argument and conn is not None and conn.segments is not None
                and nbytes >= (REF_MIN_BYTES if header.refs_segment else self._config.shm_threshold_bytes)):
            found = conn.segments.cache.locate(argument, encoded.buffers, REF_MIN_BYTES)
            if found:
                # Keep no view of the argument here (the buffers found are dropped), or the
                # check in _settle_in_place would always see one.
                rest = codec.without_buffers(encoded, set(found))
                del value, encoded
                outcome = Outcome(pending=functools.partial(self._settle_in_place, rest, found, header, conn))
                return outcome if settle_later else outcome.settle()
        return self._package_encoded(encoded, nbytes, header, conn, snapshot, lend=settle_later)

    def _package_encoded(self, encoded: Any, nbytes: int, header: worker_pb2.CallHeader,
                         conn: CallConnection | None, snapshot: bool, lend: bool = False) -> Outcome:
        segments = encoded.to_segments()
        if header.reply_in_shm and nbytes >= self._config.shm_threshold_bytes and conn is not None:
            name, pooled = conn.write_segment(segments, nbytes)  # ("", False): /dev/shm full, use TCP
            if name:
                self._stats["shm_out"] += 1
                return Outcome(shm_name=name, shm_pooled=pooled, nbytes=nbytes)
        if snapshot:
            # On the execution thread a large bulk reply is lent, not copied: the thread
            # waits until the socket took it before it runs anything else (LentReply).
            if lend and nbytes >= MIN_POOLED_BYTES and conn is not None and conn.takes_bulk(nbytes):
                self._stats["lent_out"] += 1
                return Outcome(segments=segments, nbytes=nbytes, lent=LentReply(nbytes, conn.abort_threadsafe))
            segments = reply_snapshot(segments, nbytes)
        return Outcome(segments=segments, nbytes=nbytes)

    def _settle_in_place(self, rest: codec.Encoded, found: dict[int, tuple[int, int]],
                         header: worker_pb2.CallHeader, conn: CallConnection) -> Outcome:
        # See package(): references if nothing here views the argument any more, else a copy.
        name = header.refs_segment or header.shm_name
        segments = conn.segments
        assert segments is not None  # package() found the argument in them
        cache = segments.cache
        if cache.leased(name):  # the method kept (a view of) its argument: send a copy
            buffers = list(rest.buffers)
            for index, (offset, length) in found.items():
                buffers[index] = cache.peek(name, offset, length)
            full = codec.Encoded(rest.skeleton, buffers)
            return self._package_encoded(full, full.nbytes, header, conn, True)
        outcome = self._package_encoded(rest, rest.nbytes, header, conn, True)
        outcome.refs_segment = name
        outcome.refs = [number for index in sorted(found) for number in (index, *found[index])]
        self._stats["in_place_out"] += 1
        return outcome
