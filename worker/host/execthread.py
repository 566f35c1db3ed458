"""The execution thread: the one thread a worker runs its object's synchronous code on.

CONSTRUCT builds the hosted object here and every synchronous method runs here, in
arrival order: CUDA and NCCL state belong to the thread that made them, and collectives
must be issued in the same order on every rank.

While it has no job, the thread may also read one raw call socket itself and answer its
fast calls (:mod:`podium.worker.host.directcalls`): it then waits in ``poll()`` on that
socket and on a wake-up pipe that :meth:`ExecutionThread.submit` writes to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from typing import Any

from podium import errors
from podium.worker.host.results import Outcome

__all__ = ["ExecutionThread", "Job"]

log = logging.getLogger("podium.worker.host")

# Queued by lend(): wakes a thread waiting for a job so it starts serving the reader.
_SERVE = object()


class Job:
    """One piece of work for the execution thread; its outcome goes to ``future`` (on the
    loop) or, without one, to ``on_done(context, ok, result)`` called on the loop."""

    __slots__ = ("fn", "args", "future", "state", "on_done", "context", "reply")

    def __init__(self, fn: Any, args: tuple, future: asyncio.Future | None) -> None:
        self.fn = fn
        self.args = args
        self.future = future
        self.state = 0  # 0 queued, 1 started, 2 cancelled
        self.on_done: Any = None
        self.context: Any = None
        #: Optional ``reply(context, ok, result) -> bool``, run on the execution thread: True
        #: when it answered the call itself, so the loop need not be woken just for that.
        self.reply: Any = None


class ExecutionThread:
    """The one thread that builds the hosted object and runs its sync methods, in order.

    Leaner than a ThreadPoolExecutor plus ``asyncio.wrap_future`` (a C queue in,
    one ``call_soon_threadsafe`` out), which matters on a no-op call's hot path.
    Daemon, so a method stuck in native code never blocks process exit.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: list = []  # (job, ok, result) waiting for the loop
        self._wake_scheduled = False
        # Parties on the loop waiting for outcomes already answered from this thread (see
        # hold_prompt); while there are none, those outcomes wait for the loop's next wake.
        self._prompt = 0
        # A reader lent this thread's idle time (directcalls.DirectReader), and the pipe that
        # wakes the thread from its poll() when a job comes (written only while _polling).
        self._reader: Any = None
        # Jobs running that keep every socket read by the loop meanwhile (reads_on_loop).
        self._holding = 0
        self._polling = False
        self._wake_soon = False
        self.wake_fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pipe_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="podium-exec", daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        """Thread id of the execution thread."""
        return self._thread.ident

    def submit(self, fn: Any, *args: Any) -> Job:
        """Queue ``fn(*args)``; await ``job.future`` for its result."""
        job = Job(fn, args, self._loop.create_future())
        self._queue.put(job)
        self._wake_for_job()
        return job

    def submit_reporting(self, fn: Any, args: tuple, on_done: Any, context: Any, reply: Any = None) -> Job:
        """Queue ``fn(*args)``; ``on_done(context, ok, result)`` runs on the loop when it
        finished (ok False: ``result`` is the exception). No future per job.

        ``reply(context, ok, result)`` (optional) runs on this thread first; when it returns
        True (it answered the caller itself), ``on_done`` is left for the loop's next wake-up
        or :meth:`settle` instead of waking the loop for it."""
        job = Job(fn, args, None)
        job.on_done = on_done
        job.context = context
        job.reply = reply
        self._queue.put(job)
        self._wake_for_job()
        return job

    def _wake_for_job(self) -> None:
        # A thread in poll() is woken once the loop's current step is over, not here: the
        # pipe write lets go of the GIL, and the thread would run the job while the caller
        # still holds the call's arguments (then a result computed in place in them looks
        # kept, and is copied; see SyncInvoker.package).
        if self._polling and not self._wake_soon:
            self._wake_soon = True
            self._loop.call_soon(self._wake_now)

    def _wake_now(self) -> None:
        self._wake_soon = False
        self.wake()

    def hold_prompt(self, prompt: bool) -> None:
        """While held (on the loop), every finished job wakes the loop at once, also those
        that answered from this thread: for a party waiting on ``on_done``."""
        with self._lock:
            self._prompt += 1 if prompt else -1
        self.settle()

    def cancel(self, job: Job) -> bool:
        """Drop ``job`` if it has not started; True if dropped. Call on the loop."""
        with self._lock:
            if job.state != 0:
                return False
            job.state = 2
        exc = errors.CancelledError("cancelled before it started")
        if job.future is None:
            job.on_done(job.context, False, exc)
        elif not job.future.done():
            job.future.set_exception(exc)
        return True

    def stop(self) -> None:
        """Drop queued jobs and let the thread end after the running one."""
        self._queue.put(None)
        self.wake()

    @property
    def has_reader(self) -> bool:
        """True while a reader has this thread's idle time (see :meth:`lend`)."""
        return self._reader is not None

    def lend(self, reader: Any) -> bool:
        """Give ``reader`` this thread's idle time (on the loop; see the module docstring):
        whenever no job is queued, the thread calls ``reader.serve(idle)``, which serves its
        socket (waiting on it and on :attr:`wake_fd`) while ``idle()`` says no job is queued,
        then returns; ``reader.let_go()`` hands the socket back (it calls :meth:`release` first).
        False (nothing lent) while a job holds the reads on the loop (:meth:`reads_on_loop`)."""
        with self._lock:
            if self._holding:
                return False
            self._reader = reader
        self._queue.put(_SERVE)
        return True

    @property
    def holds_reads(self) -> bool:
        """True while a running job keeps the sockets read by the loop (:meth:`reads_on_loop`)."""
        return self._holding > 0

    @contextlib.contextmanager
    def reads_on_loop(self):
        """On this thread, around a job that runs long and needs calls read meanwhile (a
        streaming call's generator, whose caller's next calls come on the same socket): the
        socket lent to this thread goes back to the loop, and none is lent until it ends."""
        with self._lock:
            self._holding += 1
            reader = self._reader
        try:
            if reader is not None:
                reader.let_go()
            yield
        finally:
            with self._lock:
                self._holding -= 1

    def release(self) -> None:
        """The reader lets go (on this thread), before it hands its socket back."""
        self._reader = None

    def wake(self) -> None:
        """Make the thread's poll() return (any thread)."""
        with self._pipe_lock:  # not once the thread closed the pipe (its number may be reused)
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:  # full: a wake-up is pending anyway
                    pass

    def _run(self) -> None:
        try:
            self._serve_jobs()
        finally:
            reader = self._reader
            if reader is not None:  # stopped while serving: the socket goes back
                reader.let_go()
            with self._pipe_lock:
                os.close(self._wake_w)
                os.close(self.wake_fd)
                self._wake_w = self.wake_fd = -1

    def _serve_jobs(self) -> None:
        while True:
            reader = self._reader
            if reader is not None and self._queue.empty():
                # A submit from now on sees _polling and wakes the poll, or its job was
                # queued before the second empty().
                self._polling = True
                if self._queue.empty():
                    reader.serve(self._queue.empty)
                self._polling = False
                continue
            job = self._queue.get()
            if job is _SERVE:
                continue
            if job is None:
                return
            with self._lock:
                if job.state != 0:
                    continue
                job.state = 1
            lent = None
            try:
                result, ok = job.fn(*job.args), True
                # The call's arguments die here, before its outcome is settled: a result
                # computed in place in an argument is sent by reference only if nothing
                # else kept that argument (SyncInvoker.package).
                job.args = ()
                if type(result) is Outcome:
                    if result.pending is not None:
                        result = result.settle()
                    lent = result.lent
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting call
                result, ok = exc, False
                job.args = ()
            # Outcomes of a burst of calls reach the loop with one wake-up, not one each; an
            # outcome answered from here waits for the loop's next wake-up. It is answered
            # under the lock, so a settle() after the caller got its reply finds it.
            with self._lock:
                answered = job.reply is not None and job.reply(job.context, ok, result)
                self._done.append((job, ok, result))
                wake = not self._wake_scheduled and (not answered or self._prompt > 0)
                self._wake_scheduled = self._wake_scheduled or wake
            if wake:
                try:
                    self._loop.call_soon_threadsafe(self.settle)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    return
            del job, result
            if lent is not None:  # the reply is sent from the method's memory: nothing may change it
                lent.wait()
                del lent

    def settle(self) -> None:
        """Run the ``on_done`` of every job that finished (on the loop)."""
        with self._lock:
            done, self._done = self._done, []
            self._wake_scheduled = False
        if not done:
            return
        for job, ok, result in done:
            if job.future is not None:
                _settle(job.future, ok, result)
                continue
            try:
                job.on_done(job.context, ok, result)
            except Exception:  # noqa: BLE001 - one reply's failure must not stop the others
                log.exception("reporting the outcome of %r failed", job.fn)


def _settle(future: asyncio.Future, ok: bool, result: Any) -> None:
    if future.done():  # cancelled: nobody sends this outcome
        if ok and type(result) is Outcome and result.lent is not None:
            result.lent.release()
        return
    if ok:
        future.set_result(result)
    else:
        future.set_exception(result)
