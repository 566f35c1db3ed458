"""The gloo trainer of the rank-replacement tests (issue 51, item 5): data-parallel SGD on a
tiny linear model, gradients all-reduced with gloo, re-formed on each new rendezvous.

``tests/integration/controller/test_rank_replacement.py`` (loopback) and
``tests/cluster/test_rank_replacement_partition.py`` (a lab network) subclass it. The workers
get it by value, with the test's own class (``podium.worker.factory.by_value`` takes every
module of the class's MRO), so nothing here needs to be importable in a worker.
"""

from __future__ import annotations

import datetime
import os
import time

import torch

from podium.worker import Dispatch, Worker, register
from podium.worker.rendezvous import Rendezvous, on_rendezvous

__all__ = ["GlooTrainer"]


class GlooTrainer(Worker):
    """Data-parallel SGD on a tiny linear model; gloo all-reduce of the gradients."""

    #: Re-form on the Podium store of each rendezvous (``rdzv.store()``), not env://.
    podium_store = False
    #: gloo's timeout (s): how long a survivor waits in a collective for a lost rank.
    gloo_timeout_s = 60

    def __init__(self):
        super().__init__()
        #: The rendezvous versions this rank's hook took.
        self.hooks: list[int] = []
        #: (version, MASTER_ADDR, store port) of each Podium store it re-formed on.
        self.stores: list[tuple[int, str, int]] = []
        self.reset()

    def _form(self, rdzv: Rendezvous | None = None):
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=self.gloo_timeout_s)
        if rdzv is not None and self.podium_store:
            dist.init_process_group("gloo", store=rdzv.store(), rank=rdzv.rank, world_size=rdzv.world_size,
                                    timeout=timeout)
            self.stores.append((rdzv.version, rdzv.master_addr, rdzv.store_port))
        else:
            dist.init_process_group("gloo", timeout=timeout)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset(self):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 1)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def form(self):
        self._form()
        return self.rank

    @on_rendezvous
    def reform(self, rdzv: Rendezvous):
        """Re-form gloo on the new rendezvous; the newcomer takes rank 0's parameters."""
        import torch.distributed as dist
        assert rdzv.rank == self.rank and str(rdzv.master_port) == os.environ["MASTER_PORT"]
        self.hooks.append(rdzv.version)
        self._form(rdzv)
        for p in self.model.parameters():
            dist.broadcast(p.data, src=0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step(self, step, stall_rank=-1):
        import torch.distributed as dist
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        self.model.zero_grad()
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        if stall_rank >= 0:
            # mid-step: the test kills, stops or cuts off the stalled rank after 1 s, so its
            # loss is the call's first failure (the others notice it in all_reduce at 2 s)
            time.sleep(600 if self.rank == stall_rank else 2.0)
        try:
            for p in self.model.parameters():
                dist.all_reduce(p.grad)  # a lost peer fails this before any parameter moves
        except Exception:
            dist.destroy_process_group()  # the ranks waiting on this one fail now too
            raise
        with torch.no_grad():
            for p in self.model.parameters():
                p -= 0.01 * p.grad / dist.get_world_size()
        return step

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def params(self):
        return [p.detach().clone() for p in self.model.parameters()]
