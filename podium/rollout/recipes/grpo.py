"""GRPO pieces shared by ``examples/grpo_vllm.py``, its test and the bench.

* :class:`GRPOActor`: a ``transformers`` causal LM and a torch optimizer; gradients are
  averaged across ranks with a gloo group built from the environment Podium sets
  (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``). It is a
  :class:`~podium.rollout.weights.WeightSource`, so a rollout elsewhere can take its weights.
* :class:`GRPOReference`: the frozen initial policy, for the KL term.
* :func:`target_token_reward`, :func:`group_advantages`: the rule-based reward and the
  group-normalised advantages.

The actor's gloo group is a private ``ProcessGroupGloo``, not ``init_process_group``: an
in-process vLLM engine takes the default process group (world size 1) for itself. Its
rendezvous is :class:`~podium.transport.authstore.StoreServer` on ``MASTER_ADDR:MASTER_PORT``
(only that address), keyed from the cluster token: a torch ``TCPStore`` would serve anyone
on every interface.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from podium.dataproto import DataProto
from podium.errors import InvalidArgumentError
from podium.rollout.weights.roles import WeightSource
from podium.worker.base import Worker
from podium.worker.decorator import Dispatch, register

__all__ = ["GRPOActor", "GRPOReference", "target_token_reward", "group_advantages", "response_log_probs",
           "gloo_group_from_env", "load_model"]

#: How long ranks wait for each other when the gloo group forms.
_RENDEZVOUS_S = 120


def gloo_group_from_env() -> Any:
    """A gloo process group over every rank, from ``MASTER_ADDR/PORT``, ``RANK``, ``WORLD_SIZE``."""
    import torch.distributed as dist

    from podium.transport.authstore import StoreServer, connect_store, derived_key
    from podium.worker import masterstore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    key = derived_key(os.environ["PODIUM_TOKEN"], f"grpo/{host}:{port}")
    # Rank 0 holds MASTER_PORT bound to the node address since it started (the port is
    # never free for another process): the store serves on that socket.
    server = StoreServer(host, key, port, listener=masterstore.take(port)) if rank == 0 else None
    store = connect_store(host, port, key, _RENDEZVOUS_S)
    group = dist.ProcessGroupGloo(dist.PrefixStore("grpo", store), rank, world,
                                  datetime.timedelta(seconds=_RENDEZVOUS_S))
    _STORES.append((server, store))  # torch calls back into the Python store: keep it alive
    return group


#: The stores of this process's groups (server or None, client), kept for the group's life.
_STORES: list = []


def response_log_probs(model: Any, batch: DataProto, temperature: float = 1.0) -> Any:
    """Per-token log-probs (N, R) of ``batch``'s responses under ``model`` (float32)."""
    import torch

    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    width = batch.batch["responses"].shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=batch.batch["position_ids"]).logits
    # The token at position t is predicted by the logits at t-1.
    logits = logits[:, -width - 1:-1].float() / max(temperature, 1e-6)
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)


def target_token_reward(batch: DataProto, target_id: int) -> Any:
    """Fraction of each response's tokens equal to ``target_id`` (N,) float32."""
    mask = batch.batch["response_mask"].float()
    hits = (batch.batch["responses"] == target_id).float() * mask
    return hits.sum(1) / mask.sum(1).clamp(min=1.0)


def group_advantages(rewards: Any, n: int, eps: float = 1e-6) -> Any:
    """GRPO advantages: each reward minus its group's mean, over the group's std (groups of n
    consecutive rows)."""
    if rewards.numel() % n:
        raise InvalidArgumentError(f"{rewards.numel()} rewards do not split into groups of {n}")
    groups = rewards.view(-1, n)
    std = groups.std(dim=1, keepdim=True) if n > 1 else groups.new_ones(groups.shape[0], 1)
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def load_model(model_path: str) -> Any:
    """The Hugging Face causal LM saved at ``model_path``, in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(model_path):
        raise InvalidArgumentError(f"model directory {model_path!r} does not exist")
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


class GRPOActor(Worker, WeightSource):
    """The trained policy: clipped-ratio policy loss plus a KL penalty to the reference."""

    def __init__(self, model_path: str, lr: float = 1e-3, clip: float = 0.2, kl_coef: float = 0.02,
                 temperature: float = 1.0) -> None:
        super().__init__()
        if not (0 < lr <= 1 and 0 < clip < 1 and 0 <= kl_coef <= 10 and 0 < temperature <= 100):
            raise InvalidArgumentError(f"bad GRPO hyper-parameters lr={lr} clip={clip} kl_coef={kl_coef} "
                                       f"temperature={temperature}")
        self.model_path, self.lr, self.clip, self.kl_coef = model_path, lr, clip, kl_coef
        self.temperature = temperature
        self.model: Any = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> int:
        """Load the model and optimizer, join the gloo group; returns the parameter count."""
        import torch

        self.model = load_model(self.model_path)
        self.model.train()
        self.optim = torch.optim.Adam(self.model.parameters(), lr=self.lr)
        self.group = gloo_group_from_env() if self.world_size > 1 else None
        return sum(p.numel() for p in self.model.parameters())

    def rollout_state_dict(self) -> dict:
        """The weights a rollout loads (the model's own names)."""
        return self.model.state_dict()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_policy(self, batch: DataProto) -> dict:
        """One optimizer step on this rank's shard (gradients averaged over ranks); metrics."""
        import torch

        mask = batch.batch["response_mask"].float()
        logp = response_log_probs(self.model, batch, self.temperature)
        old = batch.batch["old_log_probs"]
        adv = batch.batch["advantages"].unsqueeze(-1)
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
        policy = -torch.min(ratio * adv, clipped * adv)
        delta = batch.batch["ref_log_probs"] - logp
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        denom = mask.sum().clamp(min=1.0)
        loss = ((policy + self.kl_coef * kl) * mask).sum() / denom
        self.optim.zero_grad()
        loss.backward()
        if self.group is not None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.group.allreduce([flat]).wait()
            flat /= self.world_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.optim.step()
        return {"loss": loss.item(), "kl": ((kl * mask).sum() / denom).item(),
                "logp_gap": ((logp.detach() - old).abs() * mask).sum().item() / denom.item(),
                "clipfrac": (((ratio - 1).abs() > self.clip).float() * mask).sum().item() / denom.item()}


class GRPOReference(Worker):
    """The frozen initial policy: log-probs for the KL term."""

    def __init__(self, model_path: str, temperature: float = 1.0) -> None:
        super().__init__()
        self.model_path, self.temperature = model_path, temperature
        self.model: Any = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the frozen model."""
        self.model = load_model(self.model_path).eval()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        """``ref_log_probs`` (N, R) float32 of the batch's responses."""
        import torch

        with torch.no_grad():
            ref = response_log_probs(self.model, batch, self.temperature)
        return DataProto.from_dict(tensors={"ref_log_probs": ref})
