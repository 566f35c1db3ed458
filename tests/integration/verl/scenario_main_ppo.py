"""Under `podium run`: verl 0.9.1's own trainer entry (`verl.trainer.main_ppo.run_ppo` with its
`TaskRunner`, from `main_ppo_v0`) on a tiny Llama built offline, as far as a CPU allows.

What runs on Podium: `ray.init` with verl's PPO runtime_env, the TaskRunner actor, the
tokenizer and datasets in it, verl's ResourcePoolManager and RayWorkerGroup of
ActorRolloutRefWorker, and the workers' `init_model` with verl's CPU platform plugin
(VERL_PLATFORM=cpu, verl_cpu_platform.py). Where it stops is verl's own code: its process
group setup asks torch.distributed for the backend "cpu:gloo,{device}:{backend}", which is
"cpu:gloo,cpu:gloo" on a CPU platform, and torch refuses a device type named twice. The
scenario checks that the run gets exactly there.
"""

import os
import sys
import tempfile

import pandas as pd
from hydra import compose, initialize_config_dir

import verl.trainer.main_ppo as main_ppo
import tiny_chat_model
from podium.rollout.recipes.tinymodel import default_words
from verl.trainer.main_ppo_v0 import TaskRunner

work = tempfile.mkdtemp(prefix="verl-main-ppo-")
model = tiny_chat_model.build(work)
words = default_words(28)
rows = [dict(data_source="tiny", prompt=[{"role": "user", "content": f"{words[i % 28]} {words[(i + 1) % 28]}"}],
             ability="copy", reward_model={"style": "rule", "ground_truth": words[i % 28]},
             extra_info={"index": i}) for i in range(8)]
pd.DataFrame(rows).to_parquet(os.path.join(work, "train.parquet"))
pd.DataFrame(rows[:4]).to_parquet(os.path.join(work, "val.parquet"))

overrides = [
    f"data.train_files={work}/train.parquet", f"data.val_files={work}/val.parquet",
    "data.train_batch_size=2", "data.max_prompt_length=16", "data.max_response_length=8",
    f"actor_rollout_ref.model.path={model}",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
    "algorithm.adv_estimator=grpo", "trainer.use_v1=False", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
    "trainer.logger=[console]", "trainer.total_training_steps=1", "trainer.val_before_train=False",
    "trainer.device=cpu", "ray_kwargs.ray_init.num_cpus=8",
]
if os.environ.get("SCENARIO_PY_EXECUTABLE"):  # verl's GPU examples set a uv command here
    overrides.append(f"ray_kwargs.ray_init.runtime_env.py_executable='{os.environ['SCENARIO_PY_EXECUTABLE']}'")
config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
with initialize_config_dir(config_dir=config_dir, version_base=None):
    config = compose(config_name="ppo_trainer", overrides=overrides)

try:
    main_ppo.run_ppo(config, task_runner_class=TaskRunner)
except Exception as exc:  # noqa: BLE001 - the error of verl's worker, as the driver sees it
    text = f"{type(exc).__name__}: {exc}"
    print(text[-3000:], file=sys.stderr)
    # RemoteError (TaskRunner.run) of a RemoteError (the worker's init_model): verl's own
    # process-group call, on the worker, with the backend string verl built.
    assert type(exc).__name__ == "RemoteError", text[-3000:]
    assert "Duplicate device type cpu" in text and "cpu:gloo,cpu:gloo" in text, text[-3000:]
    assert "initialize_global_process_group_ray" in text and "init_model" in text, text[-3000:]
else:
    raise AssertionError("main_ppo ran to the end on a CPU: make this the headline test")
print("SCENARIO OK")
