"""The wire between a controller and a worker: call frames, payload chunks, shared memory.

- :mod:`podium.transport.callsocket`: CallFrame/ReplyFrame messages on a plain TCP socket
  (the default call connection) and the framing both ends read and write.
- :mod:`podium.transport.frames`: call frames encoded once per payload (bursts).
- :mod:`podium.transport.chunks`: payloads split into chunks on gRPC streams.
- :mod:`podium.transport.shm` and :mod:`podium.transport.shmpool`: same-host shared-memory
  segments, one-shot and reused per connection.

This layer sits on :mod:`podium.codec`, :mod:`podium.errors` and :mod:`podium.rpc`; it never
imports the worker, controller or scheduler packages.
"""
