"""The pure scheduling core: where placement groups go and which GPUs they own.

No gRPC, no asyncio, no clock, no I/O: :func:`place` is a function of a request and
a :class:`Snapshot` of the alive nodes, so it is tested table-driven without a server
and the service can call it under its lock. ``apply``/``release`` derive the next
snapshot (sharing untouched nodes and the capacity index), and :class:`BundleLedger`
accounts worker slots inside one bundle.

Modules: ``views`` (the frozen data: nodes, GPUs, requests, placements), ``index`` (capacity index), ``fit`` (one node's
GPUs), ``strategies`` (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD), ``reasons``
(Infeasible/Unavailable wording), ``placement`` (place/apply/release), ``ledger``.
"""

from podium.scheduler.core.ledger import BundleLedger
from podium.scheduler.core.views import (BundleAssignment, GpuView, Infeasible, NodeView,
                                         Placement, PlacementRequest, Snapshot, Unavailable)
from podium.scheduler.core.placement import apply, place, release

__all__ = ["GpuView", "NodeView", "Snapshot", "PlacementRequest", "BundleAssignment",
           "Placement", "Infeasible", "Unavailable", "place", "apply", "release",
           "BundleLedger"]
