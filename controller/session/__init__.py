"""The controller's session: one per process, the thing every other room of the controller
talks through.

:mod:`~podium.controller.session.runtime` holds ``init``/``shutdown`` and the
:class:`~podium.controller.session.runtime.Runtime` (the event-loop thread, the scheduler's
client, the lease); beside it live the services it runs for its calls (the death watch and
liveness, the releaser of held results, the object store, the log stream to this terminal,
the garbage collector freeze, the start-up progress lines) and the pending results that calls
settle (:mod:`~podium.controller.session.futures`). Other rooms see the runtime only through
the :class:`~podium.controller.session.contract.Session` protocol, and settle pending
results only through :class:`~podium.controller.session.contract.Sink`.
"""
