"""Podium's worker side: the API a worker class is written against.

``from podium.worker import Worker, register, Dispatch, Execute`` replaces
``from verl.single_controller.base import Worker`` and
``from verl.single_controller.base.decorator import register, Dispatch, Execute``.
Building and colocating worker classes (``ClassWithInitArgs``, ``create_colocated_worker_cls``)
is the controller's business: ``podium.controller``. The node agent (``podium.worker.agent``)
and the worker process (``podium.worker.host``) are subpackages of this one.

Importing this package stays light (no torch, no grpc): the node agent imports
``podium.worker.agent.service`` and must not pay for them.
"""

from podium.worker.base import Worker, WorkerHelper
from podium.worker.decorator import Dispatch, DynamicEnum, Execute, register
from podium.worker.rendezvous import Rendezvous, on_rendezvous

__all__ = [
    "Dispatch",
    "DynamicEnum",
    "Execute",
    "Rendezvous",
    "Worker",
    "WorkerHelper",
    "on_rendezvous",
    "register",
]
