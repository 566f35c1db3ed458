"""The wire between a controller and a worker: call frames, payload chunks, shared memory.

- :mod:`podium.transport.callsocket`: CallFrame/ReplyFrame messages on a plain TCP socket
  (the default call connection) and the framing both ends read and write, with its parts:
  :mod:`~podium.transport.framewriter` (the sending side), :mod:`~podium.transport.threadloan`
  (what the execution thread borrows), :mod:`~podium.transport.bulkframes` (bulk payloads).
- :mod:`podium.transport.frames`: call frames encoded once per payload (bursts).
- :mod:`podium.transport.chunks`: payloads split into chunks on gRPC streams, assembled
  within a per-connection budget.
- same-host shared memory, lowest first: :mod:`podium.transport.shm` (one-shot segments),
  :mod:`podium.transport.shmsegment` (the memory and budget of reusable ones),
  :mod:`podium.transport.shmpool` (a connection's reused segments, writer and reader),
  :mod:`podium.transport.shmstage` (one segment for a whole group call) and
  :mod:`podium.transport.sharedsegments` (all of them for one connection).

This layer sits on :mod:`podium.codec`, :mod:`podium.errors` and :mod:`podium.rpc`; it never
imports the worker, controller or scheduler packages.
"""
