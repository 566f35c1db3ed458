"""How one group call is split over ranks and stitched back: the dispatch and collect
functions of every mode (:mod:`~podium.controller.dispatch.modes`, verl's registry) and the
data operations they are built on (:mod:`~podium.controller.dispatch.data`). The two public
ways to extend dispatch are re-exported here.
"""

from podium.controller.dispatch.modes import (make_nd_compute_dataproto_dispatch_fn, register_dispatch_mode,
                                              update_dispatch_mode)

__all__ = ["make_nd_compute_dataproto_dispatch_fn", "register_dispatch_mode", "update_dispatch_mode"]
