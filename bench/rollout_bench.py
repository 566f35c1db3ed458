"""Rollout bench: vLLM generation through Podium vs in-process, weight sync, GRPO step split.

    . .venv-vllm/bin/activate && python -m bench.rollout_bench [--skip-100m]

Prints (numbers, never asserted):

1. generation tokens/s of ``generate_sequences`` through a 1-rank Podium group (as the
   controller sees it: dispatch, DataProto in and out, padding) vs the same engine's bare
   ``llm.generate`` timed inside that worker process (no Podium around it), calls
   alternating (the machine may be shared), and their ratio;
2. in-process weight sync (colocated actor -> rollout, ``update_weights(source="actor")``
   as the controller sees it, and the engine's load inside it) for the tiny model and a
   ~100M-parameter random Llama, vs copying that state dict once (``clone`` of every tensor);
3. cross-process weight sync over the data path (``push_weights``, 64 MiB buckets), MB/s;
4. the GRPO step of ``examples/grpo_vllm.py`` split into generation, training and sync.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import tempfile
import time

import torch

from podium.dataproto import DataProto
from podium.rollout.recipes.grpo import GRPOActor
from podium.rollout.vllm import VLLMRollout
from podium.worker import Dispatch, register

ROOT = pathlib.Path(__file__).resolve().parents[1]


class BenchActor(GRPOActor):
    """A GRPO actor that also times one copy of its own state dict."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def copy_once_s(self, repeat: int = 3) -> float:
        """Median seconds of cloning every tensor of the state dict once."""
        times = []
        for _ in range(max(1, min(repeat, 20))):
            start = time.monotonic()
            copy = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            times.append(time.monotonic() - start)
            del copy
        return statistics.median(times)


def _prompts(count: int, width: int = 8) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 32, (count, width), generator=gen)
    ids[:, 0] = 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def _gen_config(model_dir: str) -> dict:
    return dict(model_path=model_dir, n=8, max_tokens=32, ignore_eos=True, max_model_len=64,
                kv_cache_memory_bytes=32 << 20, seed=0)


class BenchRollout(VLLMRollout):
    """The rollout role plus a method that times the engine alone, in the same process."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def raw_generate_s(self, token_lists: list) -> float:
        """Seconds of one bare ``llm.generate`` of ``token_lists`` (no DataProto, no padding)."""
        start = time.monotonic()
        self.llm.generate([{"prompt_token_ids": ids} for ids in token_lists],
                          sampling_params=self._sampling_params(self.config.n), use_tqdm=False)
        return time.monotonic() - start


def bench_generation(model_dir: str, repeat: int) -> dict:
    """Tokens/s of ``generate_sequences`` through Podium (1 rank, as the controller sees it)
    vs the same engine's bare ``generate`` timed inside that worker (no Podium around it);
    calls alternate, so both see the same load on a shared machine."""
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup

    prompts = _prompts(16)
    token_lists = [row.tolist() for row in prompts.batch["input_ids"]]
    cfg = _gen_config(model_dir)
    tokens = len(prompts) * cfg["n"] * cfg["max_tokens"]
    wg = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1),
                     ClassWithInitArgs(BenchRollout, cfg), name_prefix="bench-rollout")
    podium_s, direct_s = [], []
    try:
        wg.init_model()
        wg.generate_sequences(prompts)  # warm-up, both paths
        wg.raw_generate_s(token_lists)
        for _ in range(repeat * 2):
            start = time.monotonic()
            wg.generate_sequences(prompts)
            podium_s.append(time.monotonic() - start)
            direct_s.append(wg.raw_generate_s(token_lists)[0])
    finally:
        wg.shutdown()
    p, d = statistics.median(podium_s), statistics.median(direct_s)
    return {"tokens": tokens, "podium_tok_s": tokens / p, "direct_tok_s": tokens / d, "ratio": d / p}


def bench_sync(model_dir: str, repeat: int, cross: bool) -> dict:
    """In-process sync (colocated) vs one state-dict copy; optionally the cross-process path."""
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup, create_colocated_worker_cls
    from podium.rollout.sync import push_weights
    from podium.rollout.vllm import VLLMRollout

    cfg = dict(model_path=model_dir, n=1, max_tokens=4, max_model_len=64, kv_cache_memory_bytes=32 << 20)
    cls = create_colocated_worker_cls({"actor": ClassWithInitArgs(BenchActor, model_dir),
                                       "rollout": ClassWithInitArgs(VLLMRollout, cfg)})
    wg = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), cls, name_prefix="bench-sync")
    out: dict = {}
    try:
        roles = wg.spawn({"actor", "rollout"})
        params = roles["actor"].init_model()[0]
        roles["rollout"].init_model()
        roles["rollout"].update_weights(source="actor")  # warm-up
        total, load = [], []
        for _ in range(repeat):
            start = time.monotonic()
            stats = roles["rollout"].update_weights(source="actor")[0]
            total.append(time.monotonic() - start)
            load.append(stats["load_s"])
        out.update(params=params, bytes=stats["bytes"], sync_s=statistics.median(total),
                   load_s=statistics.median(load), copy_s=roles["actor"].copy_once_s(repeat)[0])
        out["sync_over_copy"] = out["sync_s"] / out["copy_s"]
    finally:
        wg.shutdown()
    if cross:
        actor = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1),
                            ClassWithInitArgs(BenchActor, model_dir), name_prefix="bench-actor")
        rollout = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1),
                              ClassWithInitArgs(VLLMRollout, cfg), name_prefix="bench-rollout2")
        try:
            actor.init_model()
            rollout.init_model()
            push_weights(actor, rollout)  # warm-up
            runs = [push_weights(actor, rollout) for _ in range(repeat)]
            best = min(runs, key=lambda r: r["seconds"])
            out.update(cross_s=best["seconds"], cross_MBps=best["MBps"], cross_buckets=best["buckets"])
        finally:
            actor.shutdown()
            rollout.shutdown()
    return out


def bench_grpo(model_dir: str, steps: int) -> dict:
    """Mean seconds per GRPO step in generation, training and sync (steps after the first)."""
    spec = importlib.util.spec_from_file_location("grpo_vllm", ROOT / "examples" / "grpo_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build_tiny_llama(model_dir, words=module.WORDS, seed=0)
    history = module.train(model_dir, steps, log=lambda _line: None)[1:]
    mean = {k: statistics.mean(h[k] for h in history) for k in ("gen_s", "train_s", "sync_s")}
    mean["reward_first"], mean["reward_last"] = history[0]["reward"], history[-1]["reward"]
    return mean


def main() -> None:
    from podium import init, shutdown
    from podium.rollout.recipes.tinymodel import LLAMA_100M, build_tiny_llama

    parser = argparse.ArgumentParser(description="vLLM rollout bench")
    parser.add_argument("--repeat", type=int, default=5, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--grpo-steps", type=int, default=10, choices=range(2, 201), metavar="2..200")
    parser.add_argument("--skip-100m", action="store_true", help="leave out the ~100M-parameter model")
    parser.add_argument("--only", choices=("gen", "sync", "grpo"), help="run one part only")
    args = parser.parse_args()
    init()
    try:
        with tempfile.TemporaryDirectory(prefix="podium-rollout-bench-") as tmp:
            tiny = build_tiny_llama(os.path.join(tmp, "tiny"), seed=0)
            parts = {args.only} if args.only else {"gen", "sync", "grpo"}
            gen = bench_generation(tiny, args.repeat) if "gen" in parts else None
            gen and print(f"generation: {gen['tokens']} tokens/call; Podium {gen['podium_tok_s']:.0f} tok/s, "
                  f"engine alone {gen['direct_tok_s']:.0f} tok/s, ratio {gen['ratio']:.3f}", flush=True)
            sizes = [("tiny", tiny)] if "sync" in parts else []
            if sizes and not args.skip_100m:
                sizes.append(("100M", build_tiny_llama(os.path.join(tmp, "100m"), seed=0, **LLAMA_100M)))
            for label, path in sizes:
                s = bench_sync(path, args.repeat, cross=True)
                print(f"weight sync {label} ({s['params'] / 1e6:.2f}M params, {s['bytes'] / 1e6:.1f} MB): in-process "
                      f"{s['sync_s'] * 1e3:.1f} ms (engine load {s['load_s'] * 1e3:.1f} ms), one state-dict copy "
                      f"{s['copy_s'] * 1e3:.1f} ms, ratio {s['sync_over_copy']:.2f}; cross-process "
                      f"{s['cross_s'] * 1e3:.1f} ms in {s['cross_buckets']} bucket(s), {s['cross_MBps']:.0f} MB/s",
                      flush=True)
            if "grpo" not in parts:
                return
            g = bench_grpo(os.path.join(tmp, "grpo"), args.grpo_steps)
            step = g["gen_s"] + g["train_s"] + g["sync_s"]
            print(f"GRPO step (2 ranks, 8 prompts x 8 samples x 8 tokens): {step * 1e3:.0f} ms = generation "
                  f"{g['gen_s'] * 1e3:.0f} ms + training {g['train_s'] * 1e3:.0f} ms (ref log-probs + update) + "
                  f"sync {g['sync_s'] * 1e3:.0f} ms", flush=True)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
