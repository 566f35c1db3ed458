"""Podium quickstart: a tiny but real RL post-training loop, verl style, on your CPU.

One controller (this script) drives 2 worker processes. Each process hosts BOTH an actor
(a categorical policy over a few tokens) and a critic (a learned baseline), colocated with
``create_colocated_worker_cls``, exactly like verl's ``WorkerDict``. Each step:

1. the actor samples responses for its half of the prompts   (DP_COMPUTE_PROTO),
2. the controller scores them with a rule-based reward         (plain Python),
3. the critic computes advantages = reward - baseline, updates  (DP_COMPUTE_PROTO),
4. the actor takes a policy-gradient step; gradients are averaged across the 2 ranks
   with torch.distributed (gloo), initialised from the env Podium sets (DP_COMPUTE_METRIC).

The mean reward printed per step rises from ~0.2 towards 1.0. Run it with

    python examples/quickstart.py [--steps N] [--timeline trace.json]

``--timeline`` writes the run's Chrome trace (``podium.timeline``: every rank's calls, the
controller's dispatch and collect) for Perfetto or ``chrome://tracing``.

``init()`` starts an embedded scheduler and node agent (8 fake GPUs when there are none);
pass ``init(address="host:port")`` to use a running cluster instead.
"""

from __future__ import annotations

import argparse
import time

import torch

from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup, create_colocated_worker_cls
from podium import init, shutdown, timeline
from podium.dataproto import DataProto
from podium.worker import Dispatch, Worker, register

VOCAB = 6          # tokens the policy can emit
RESPONSE_LEN = 4   # tokens per response
TARGET = 3         # the rule: every token equal to TARGET earns 1/RESPONSE_LEN
BATCH = 64         # prompts per step (32 per rank)
STEPS = 25


class Actor(Worker):
    """The policy: one logit vector per prompt type, trained with REINFORCE."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, seed: int) -> int:
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")  # RANK/WORLD_SIZE/MASTER_* come from Podium
        torch.manual_seed(seed)  # same init on every rank; the all-reduce keeps them equal
        self.logits = torch.nn.Parameter(torch.zeros(2, VOCAB))
        self.optim = torch.optim.Adam([self.logits], lr=0.15)
        self.gen = torch.Generator().manual_seed(seed + self.rank)  # different samples per rank
        return self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        probs = torch.softmax(self.logits.detach()[prompts.batch["prompt"]], dim=-1)
        responses = torch.multinomial(probs, RESPONSE_LEN, replacement=True, generator=self.gen)
        prompts.batch["responses"] = responses
        return prompts

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_policy(self, batch: DataProto) -> dict:
        import torch.distributed as dist
        logp = torch.log_softmax(self.logits[batch.batch["prompt"]], dim=-1)
        token_logp = logp.gather(1, batch.batch["responses"]).sum(-1)
        loss = -(batch.batch["advantages"] * token_logp).mean()
        self.optim.zero_grad()
        loss.backward()
        dist.all_reduce(self.logits.grad)          # average gradients across data-parallel ranks
        self.logits.grad /= dist.get_world_size()
        self.optim.step()
        return {"actor/loss": loss.item(), "rank": self.rank}


class Critic(Worker):
    """A learned baseline per prompt type: advantages = reward - V(prompt)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.values = torch.nn.Parameter(torch.zeros(2))
        self.optim = torch.optim.SGD([self.values], lr=0.5)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_advantages(self, batch: DataProto) -> DataProto:
        import torch.distributed as dist
        v = self.values[batch.batch["prompt"]]
        batch.batch["advantages"] = batch.batch["rewards"] - v.detach()
        loss = ((v - batch.batch["rewards"]) ** 2).mean()
        self.optim.zero_grad()
        loss.backward()
        dist.all_reduce(self.values.grad)
        self.values.grad /= dist.get_world_size()
        self.optim.step()
        return batch


def rule_based_reward(batch: DataProto) -> torch.Tensor:
    """1/RESPONSE_LEN for every TARGET token in the response (verl's 'reward function')."""
    return (batch.batch["responses"] == TARGET).float().mean(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description="Podium quickstart: a tiny RL loop on CPU")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    parser.add_argument("--timeline", metavar="FILE", help="write the run's Chrome trace to FILE")
    args = parser.parse_args()
    start = time.monotonic()
    init()
    pool = ResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    cls = create_colocated_worker_cls({"actor": ClassWithInitArgs(Actor), "critic": ClassWithInitArgs(Critic)})
    wg = WorkerGroup(resource_pool=pool, ray_cls_with_init=cls, name_prefix="quickstart")
    roles = wg.spawn({"actor", "critic"})
    actor, critic = roles["actor"], roles["critic"]
    actor.init_model(seed=0)
    critic.init_model()
    print(f"{wg.world_size} colocated actor+critic workers up in {time.monotonic() - start:.1f}s")

    prompts = DataProto.from_dict(tensors={"prompt": torch.arange(BATCH) % 2})
    for step in range(1, args.steps + 1):
        batch = actor.generate_sequences(prompts)
        batch.batch["rewards"] = rule_based_reward(batch)
        batch = critic.compute_advantages(batch)
        metrics = actor.update_policy(batch)
        print(f"step {step:2d}  mean reward {batch.batch['rewards'].mean().item():.3f}  "
              f"actor loss {sum(m['actor/loss'] for m in metrics) / len(metrics):+.3f}")
    if args.timeline:
        timeline(args.timeline)
        print(f"timeline written to {args.timeline}")
    wg.shutdown()
    shutdown()
    print(f"done in {time.monotonic() - start:.1f}s")


if __name__ == "__main__":
    main()
