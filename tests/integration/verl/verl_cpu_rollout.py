"""A CPU rollout backend for verl 0.9.1, registered through verl's own extension points in
every process that imports verl (``VERL_USE_EXTERNAL_MODULES=verl_cpu_rollout``):

- ``RolloutReplicaRegistry`` "podium_cpu": :class:`PodiumCPUReplica`, a verl ``RolloutReplica``
  whose ``launch_servers`` starts one :class:`CPUServer` actor per replica;
- ``_ROLLOUT_REGISTRY[("podium_cpu", "async")]``: :class:`CPURolloutAdapter`, the
  ``BaseRollout`` that verl's ``CheckpointEngineWorker`` builds in each rollout worker.

The server follows verl's server interface (``generate(request_id, *, prompt_ids,
sampling_params, ...) -> TokenOutput`` and the control methods the replica calls), generating
with transformers on the CPU. verl's own replicas start vLLM, SGLang or TensorRT-LLM engines
on a GPU.
"""

import asyncio

import torch

import ray
from verl.workers.rollout import base as _rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput


class CPUServer:
    """A rollout server with verl's interface: transformers on the CPU."""

    def __init__(self, model_path: str, seed: int) -> None:
        from transformers import AutoModelForCausalLM
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
        self.model.eval()
        self.served = 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None,
                       **kwargs) -> TokenOutput:
        def run():
            max_tokens = int(sampling_params.get("max_tokens") or sampling_params.get("max_new_tokens") or 8)
            ids = torch.tensor([prompt_ids])
            with torch.no_grad():
                out = self.model.generate(ids, max_new_tokens=max_tokens, do_sample=True,
                                          temperature=float(sampling_params.get("temperature", 1.0)) or 1.0,
                                          output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            tokens = out.sequences[0, ids.shape[1]:].tolist()
            logps = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, tokens)]
            return TokenOutput(token_ids=tokens, log_probs=logps, stop_reason="completed")
        self.served += 1
        return await asyncio.to_thread(run)

    def served_count(self) -> int:
        return self.served

    async def wake_up(self): return None
    async def sleep(self): return None
    async def clear_kv_cache(self): return None
    async def abort_all_requests(self, reject_request=False): return None
    async def resume_generation(self): return None


class PodiumCPUReplica(RolloutReplica):
    """verl's RolloutReplica with one CPUServer actor per replica."""

    async def launch_servers(self):
        server = ray.remote(CPUServer).options(name=f"podium_cpu_server_{self.replica_rank}").remote(
            self.model_config.path, self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"podium-cpu-replica-{self.replica_rank}"


RolloutReplicaRegistry.register("podium_cpu", lambda: PodiumCPUReplica)


class CPURolloutAdapter(BaseRollout):
    """The rollout side of verl's CheckpointEngineWorker for the CPU server: weights arrive
    through verl's checkpoint engine and are counted (the server keeps its own copy)."""

    def __init__(self, config, model_config, device_mesh=None, **kwargs):
        super().__init__(config, model_config, device_mesh)
        self.tensors_received = 0

    async def resume(self, tags: list[str]):
        return None

    async def update_weights(self, weights, **kwargs):
        for _name, _tensor in weights:
            self.tensors_received += 1

    async def release(self):
        return None


RolloutReplicaRegistry.register("podium_cpu", lambda: PodiumCPUReplica)
_rollout_base._ROLLOUT_REGISTRY[("podium_cpu", "async")] = f"{__name__}.CPURolloutAdapter"
