"""The caller's side of a worker: what any process that calls a worker holds.

- :mod:`~podium.worker.caller.channel`: :class:`WorkerChannel`, the gRPC channel and its
  unary RPCs (Describe, Fetch, Release, Shutdown): enough to read a worker's results.
- :mod:`~podium.worker.caller.client`: :class:`WorkerClient`, a channel plus the call
  connection (raw socket or gRPC stream) that carries calls and their replies.
- :mod:`~podium.worker.caller.pendingcalls`: the book of calls in flight and the ``Sink``
  their outcomes settle.
- :mod:`~podium.worker.caller.replydecoder`: reply frames back into values.
- :mod:`~podium.worker.caller.streaming`: the hidden method names and bounds of a streaming
  call (``num_returns="streaming"``), shared with the worker host.

The controller uses it for its workers, and a worker for its peers (arguments fetched from
another worker). Importing it loads grpc; ``podium.worker`` itself stays light.
"""
