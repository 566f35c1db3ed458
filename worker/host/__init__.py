"""The worker host: the process that serves one user object's ``@register``ed methods.

- :mod:`~podium.worker.host.process`: starting a host, in-process (:func:`start_host`) or as
  ``python -m podium.worker.host --ready-fd N`` (what the node agent starts).
- :mod:`~podium.worker.host.runtime`: the hosted object, its calls and held results (no gRPC).
- :mod:`~podium.worker.host.servicer`: the thin ``podium.v1.Worker`` gRPC service over it.
- :mod:`~podium.worker.host.callstream`: one client's call connection (socket or gRPC stream).
- :mod:`~podium.worker.host.admission`: the one way a call gets in (when it may start, its
  order, what can still stop it); :mod:`~podium.worker.host.activecall`: a call once started.
- :mod:`~podium.worker.host.directcalls`: the execution thread reading the raw socket itself.
- :mod:`~podium.worker.host.execthread`: the thread that runs user methods in call order;
  :mod:`~podium.worker.host.invoke`: running one there and packaging what it returned.
- :mod:`~podium.worker.host.heldstore`: results held for ``blocking=False`` callers.
- :mod:`~podium.worker.host.itemstreams`: streaming calls, their items held as yielded.
- :mod:`~podium.worker.host.objectstore`: values held for ``put`` (a worker's own, or a
  controller's store with a server of its own): :func:`object_store`, the one function of
  the host that the controller calls.
- :mod:`~podium.worker.host.config` and :mod:`~podium.worker.host.results`: the host's
  settings, and what results and user errors become.
"""

from podium.worker.host.objectstore import ObjectStore, StoreServer, object_store

__all__ = ["ObjectStore", "StoreServer", "object_store"]
