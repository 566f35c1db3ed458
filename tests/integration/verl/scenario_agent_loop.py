"""Under `podium run`: verl 0.9.1's rollout path, driven as its PPO trainer drives it
(`RayPPOTrainer.init_workers`): `LLMServerManager.create`, then `AgentLoopManager.create` with
the manager's `LLMServerClient` (which holds the load-balancer actor's handle), then
`generate_sequences` on a batch of prompts. verl's own classes run each step:

- `LLMServerManager` builds a `RolloutReplica` per replica and verl's
  `GlobalRequestLoadBalancer` actor, whose constructor gets the servers' actor handles;
- `AgentLoopManager` builds `AgentLoopWorker` actors whose constructor gets the client
  (holding the load balancer's handle), and gathers their `generate_sequences` with
  `await asyncio.gather(*[worker.generate_sequences.remote(chunk) ...])`;
- each `AgentLoopWorker` runs verl's `SingleTurnAgentLoop`, whose client awaits the load
  balancer's `acquire_server.remote()` (a handle in a result) and the server's
  `generate.remote()`.

The rollout server is the one part that is not verl's: verl's replicas (vLLM, SGLang,
TensorRT-LLM) start an inference engine on a GPU. verl_cpu_rollout.py registers a CPU one
through verl's `RolloutReplicaRegistry` (loaded in every process by
`VERL_USE_EXTERNAL_MODULES`); it follows verl's server interface and generates with
transformers on a tiny Llama built offline.
"""

import os
import tempfile

import numpy as np
import torch
from hydra import compose, initialize_config_dir

import ray
import verl.trainer.main_ppo as main_ppo
import tiny_chat_model
from podium.rollout.recipes.tinymodel import default_words
from verl import DataProto
from verl.experimental.agent_loop import AgentLoopManager
from verl.workers.rollout.llm_server import LLMServerManager


work = tempfile.mkdtemp(prefix="verl-agent-loop-")
model = tiny_chat_model.build(work)

overrides = [
    f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=podium_cpu",
    "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.prompt_length=16",
    "actor_rollout_ref.rollout.response_length=8", "actor_rollout_ref.rollout.agent.num_workers=2",
    "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
    "data.max_prompt_length=16", "data.max_response_length=8", "trainer.n_gpus_per_node=2", "trainer.nnodes=1",
    "trainer.device=cpu",
]
config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
with initialize_config_dir(config_dir=config_dir, version_base=None):
    config = compose(config_name="ppo_trainer", overrides=overrides)

ray.init(num_cpus=16, num_gpus=4)
# As RayPPOTrainer.init_workers does (standalone rollout: no training worker group on a CPU).
llm_server_manager = LLMServerManager.create(config=config, worker_group=None)
manager = AgentLoopManager.create(config=config, llm_client=llm_server_manager.get_client(),
                                  teacher_client=None, reward_loop_worker_handles=None)

words = default_words(28)
prompts = [[{"role": "user", "content": f"{words[i % 28]} {words[(i + 3) % 28]}"}] for i in range(4)]
batch = DataProto.from_dict(
    tensors={"dummy_tensor": torch.zeros(4, 1)},
    non_tensors={"raw_prompt": np.array(prompts, dtype=object), "index": np.arange(4),
                 "agent_name": np.array(["single_turn_agent"] * 4, dtype=object),
                 "data_source": np.array(["tiny"] * 4, dtype=object)},
    meta_info={"global_steps": 1, "validate": False})
output = manager.generate_sequences(batch)
responses = output.batch["responses"]
print("responses:", tuple(responses.shape), "prompts:", tuple(output.batch["prompts"].shape))
assert responses.shape[0] == 4 and responses.shape[1] == 8, responses.shape
assert int(output.batch["response_mask"].sum()) > 0, "no response token was generated"
served = sum(ray.get([s._server_handle.served_count.remote() for s in llm_server_manager.get_replicas()]))
print("served:", served)
assert served == 4, served
print("SCENARIO OK")
