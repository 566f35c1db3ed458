"""The one way into the worker host for a call: when it may start, in which order, and how
long a CANCEL or its deadline can still stop it.

A call's frame is read by the loop (``CallStream.run``) or by the execution thread itself
(:mod:`podium.worker.host.directcalls`). Both ask :meth:`CallAdmission.admit` whether the
call may run on the execution thread at once (then :class:`~podium.worker.host.invoke.SyncInvoker`
runs it); a call it declines takes the loop's general path, which takes its place in order with
:meth:`CallAdmission.reserve_gate` and is checked by :meth:`CallAdmission.check_start`
before it reaches the thread. The rules (their cases are the table of
tests/unit/worker/host/test_admission.py):

- **Order.** Synchronous calls reach the execution thread in the order the host admitted
  them. A call runs at once only while nothing earlier waits: the object is built and the
  last gate is open. Otherwise it waits at its gate until its predecessor has reached the
  thread (or has been resolved otherwise).
- **Cancel.** A CANCEL stops a call until the execution thread starts it, wherever it waits
  (arriving, at its gate or fetching its arguments, queued on the thread, or read by the
  thread and not yet run); the call is answered CancelledError. A started call runs to its end.
- **Deadline.** A call's deadline counts from its admission; a call that is still waiting
  when it passes is answered DeadlineExceededError, and one that started runs to its end.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from podium import codec, errors, refs
from podium.v1 import worker_pb2
from podium.worker.host.activecall import ActiveCall
from podium.worker.host.decodeonce import DecodeFailed

__all__ = ["AdmittingHost", "CallAdmission", "Declined"]

#: Method names whose lookup admission keeps (a class answering any name must not grow it).
_MAX_FOUND = 1024


class Declined:
    """A call admission sent to the general path after it decoded the payload and found the
    method: both go along, so ``HostRuntime.run_call`` neither decodes nor looks up again."""

    __slots__ = ("found", "value")

    def __init__(self, value: Any, found: tuple[Any, bool, bool]) -> None:
        self.value = value
        #: ``(bound method, is_async, materialize_futures)``, as ``lookup`` gave it.
        self.found = found


class AdmittingHost(Protocol):
    """What admission asks of the host (a ``HostRuntime``)."""

    @property
    def construct_state(self) -> str:
        """none | pending | done | failed."""

    def lookup(self, name: str) -> tuple[Any, bool, bool]:
        """(bound method, is_async, materialize_futures) or UnknownMethodError."""

    @property
    def held(self) -> Any:
        """The held results (a thread-safe ``HeldStore``): a call's header may release some."""


class CallAdmission:
    """One host's admission of calls (see the module docstring); on the loop, except
    :meth:`admit`, which the execution thread also runs (it reads the loop's state, changes none;
    it releases the held results the header lists, which the store's lock guards)."""

    def __init__(self, host: AdmittingHost, loop: asyncio.AbstractEventLoop) -> None:
        self._host = host
        self._loop = loop
        # Each call on the general path takes a gate future at admission and completes it
        # once it has been handed to the execution thread (or resolved otherwise), after its
        # predecessor's: sync calls thus reach the thread in order even when an earlier one
        # waits for its arguments to be fetched.
        self.gate: asyncio.Future = loop.create_future()
        self.gate.set_result(None)
        # lookup's answers for the hosted object, by method name (both threads admit calls).
        self._found: dict[str, tuple[Any, bool, bool]] = {}

    def in_order_now(self) -> bool:
        """True while a call may start at once: the object is built and nothing earlier waits."""
        return self._host.construct_state == "done" and self.gate.done()

    def admit(self, header: worker_pb2.CallHeader, data: bytes) -> tuple[Any, Any]:
        """``(fn, (args, kwargs))`` when a CALL may run on the execution thread at once; else
        ``(None, x)``, ``x`` being what the general path (``HostRuntime.run_call``) takes
        instead: a :class:`Declined` (the payload decoded and the method found), the decoded
        payload, a DecodeFailed, or None (not decoded).

        Every CALL is admitted here: a one-frame one as it is read (by the loop or by the
        execution thread), a bulk or multi-frame one once its payload is whole
        (``CallStream.start``; it then takes the general path in any case).

        The payload is decoded here once (its unpickling may run user code): what the call
        needs beyond that (a ref argument to fetch, an ``async def`` method, a wait for an
        earlier call) sends it to the general path with its value."""
        host = self._host
        if header.release:  # held results the caller dropped ride on its calls
            host.held.release(header.release)
        if host.construct_state != "done" or not self.gate.done():  # (in_order_now, inline: hot)
            return None, None
        try:
            value = codec.decode(data)  # (a call without arguments: the codec's table, no unpickling)
        except Exception as exc:  # noqa: BLE001 - run_call reports it (decoding again would run
            return None, DecodeFailed(exc)  # the payload's unpickling code twice: decodeonce.py)
        if type(value) is not tuple or len(value) != 2:
            if value is None:  # None would read as "not decoded" and be decoded again
                return None, DecodeFailed(errors.InvalidArgumentError(
                    "a CALL payload must decode to (args, kwargs), got NoneType"))
            return None, value
        method = header.method
        found = self._found.get(method)
        if found is None:
            try:
                found = host.lookup(method)
            except Exception:  # noqa: BLE001 - run_call looks up again and reports it
                return None, value
            # Kept: each call looked up a bound method afresh. The object is built once and
            # calls are admitted only after that, so what was found stays right.
            if len(self._found) >= _MAX_FOUND:
                self._found = {}  # (a new dict: the other thread may be reading)
            self._found[method] = found
        fn, is_async, materialize = found
        if is_async:
            return None, Declined(value, found)
        args, kwargs = value
        if materialize and (args or kwargs) and (any(map(refs.is_ref, args))
                                                 or any(map(refs.is_ref, kwargs.values()))):
            return None, Declined(value, found)
        return fn, value

    def reserve_gate(self) -> tuple[asyncio.Future, asyncio.Future]:
        """A general-path call takes its place in order: (predecessor's gate, this call's gate)."""
        prev, mine = self.gate, self._loop.create_future()
        self.gate = mine
        return prev, mine

    @staticmethod
    def open_gate(prev: asyncio.Future, mine: asyncio.Future) -> None:
        """Complete ``mine`` once ``prev`` is complete (never before it)."""
        if mine.done():
            return
        if prev.done():
            mine.set_result(None)
            return

        def follow(_: asyncio.Future) -> None:
            if not mine.done():
                mine.set_result(None)

        prev.add_done_callback(follow)

    @staticmethod
    def check_start(active: ActiveCall, what: str) -> None:
        """Just before a general-path call goes to the execution thread: CancelledError if a
        CANCEL came, DeadlineExceededError if its deadline passed while it waited."""
        if active.cancelled:
            raise errors.CancelledError(f"{what} cancelled before it started")
        if active.deadline and time.monotonic() > active.deadline:
            raise errors.DeadlineExceededError(f"{what} reached its deadline before it started")
