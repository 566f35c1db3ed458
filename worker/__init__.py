"""Podium's worker side: the API a worker class is written against.

``from podium.worker import Worker, register, Dispatch, Execute`` replaces
``from verl.single_controller.base import Worker`` and
``from verl.single_controller.base.decorator import register, Dispatch, Execute``.
The node agent and the worker host live in sub-modules of this package.

Importing this package stays light (no torch, no grpc): the node agent imports
``podium.worker.agent.service`` and must not pay for them.
"""

from podium.worker.base import Worker, WorkerHelper
from podium.worker.colocate import (
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
)
from podium.worker.decorator import MAGIC_ATTR, Dispatch, DynamicEnum, Execute, register
from podium.worker.factory import ClassWithInitArgs, RayClassWithInitArgs

__all__ = [
    "Worker",
    "WorkerHelper",
    "register",
    "Dispatch",
    "Execute",
    "MAGIC_ATTR",
    "DynamicEnum",
    "ClassWithInitArgs",
    "RayClassWithInitArgs",
    "create_colocated_worker_cls",
    "create_colocated_worker_raw_cls",
    "create_colocated_worker_cls_fused",
]
