"""The worker host: the process that serves one user object's ``@register``ed methods.

- :mod:`~podium.worker.host.servicer`: the Worker gRPC service, the host's state and ``main``
  (``python -m podium.worker.host --ready-fd N``, started by the node agent).
- :mod:`~podium.worker.host.callstream`: one client's call connection (socket or gRPC stream).
- :mod:`~podium.worker.host.execthread`: the thread that runs user methods in call order.
- :mod:`~podium.worker.host.heldstore`: results held for ``blocking=False`` callers.
"""
