"""``VLLMRollout``: a rollout role hosting a vLLM engine inside the worker process.

verl's hybrid engine, on Podium: the engine lives in the same process as the training
actor (colocate both with ``create_colocated_worker_cls``), takes the actor's new weights
in place after each update, and on GPU sleeps while the actor trains. Tensor parallelism is
1 per rank; data parallelism across ranks is the usual ``DP_COMPUTE_PROTO`` dispatch.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here before vLLM is
imported), eager, with an explicit KV-cache budget. In-process vLLM changes its host
process: ``torch.set_num_threads`` becomes a no-op, Python's ``random`` is reseeded with
the engine's seed, and on CPU a NUMA memory policy is applied.

Methods (all answer bad input with an error naming the cause; the worker keeps serving):

* ``init_model(model_path=None)``: build the engine (ONE_TO_ALL);
* ``generate_sequences(prompts)``: ``n`` samples per prompt (DP_COMPUTE_PROTO), fields in
  :mod:`podium.rollout.outputs`;
* ``update_weights(source=..., weights=..., bucket=..., finish=...)``: new weights in place;
* ``sleep(level)`` / ``wake_up()``: vLLM sleep mode on GPU, a logged no-op on CPU;
* ``engine_info()``: what the engine holds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from podium.dataproto import DataProto
from podium.errors import FailedPreconditionError, InvalidArgumentError
from podium.rollout.config import RolloutConfig, kv_bytes_per_token
from podium.rollout.outputs import build_output, prompt_token_lists
from podium.rollout.weights.endpoint import WeightEndpoint
from podium.rollout.weights.plan import check_weights, sibling_state_dict
from podium.worker.base import Worker
from podium.worker.decorator import Dispatch, register

__all__ = ["VLLMRollout", "expected_weight_shapes", "check_model_dir", "build_llm", "load_into_engine",
           "cleanup_vllm_process_state"]

log = logging.getLogger("podium.rollout")


def _quiet_derived_layers(record: logging.LogRecord) -> bool:
    """Drop vLLM's "RotaryEmbedding: Failed to load weights" on every reload: its cos/sin cache
    is derived, no state dict carries it, and vLLM keeps the tensor it had (the right one)."""
    return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")

#: vLLM's KV-cache block size on CPU and GPU: a budget holds whole blocks.
_BLOCK_TOKENS = 16
#: Longest wait for a weight bucket fetched from its owner.
_FETCH_TIMEOUT_S = 300.0


def expected_weight_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the Hugging Face model at ``model_path`` (built on the meta
    device, so it costs no memory): the names a weight update must use."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def cleanup_vllm_process_state() -> None:
    # vLLM keeps its (world size 1) process groups in module globals; a second engine in the
    # same process needs them gone. Only when vLLM was imported: nothing to undo otherwise.
    import sys

    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is not None:
        state.cleanup_dist_env_and_memory()


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def check_model_dir(cfg: RolloutConfig, path: str) -> None:
    """Raise InvalidArgumentError when ``path`` is no model directory, or when
    ``cfg.kv_cache_memory_bytes`` cannot hold one sequence of ``max_model_len``."""
    if not os.path.isdir(path):
        raise InvalidArgumentError(f"model directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InvalidArgumentError(f"model directory {path!r} has no config.json")
    try:
        per_token = kv_bytes_per_token(path, cfg.dtype_bytes)
    except (KeyError, ValueError, OSError) as exc:
        raise InvalidArgumentError(f"model directory {path!r}: config.json does not describe a "
                                   f"decoder model ({exc!r})") from None
    blocks = -(-cfg.max_model_len // _BLOCK_TOKENS)
    need = blocks * _BLOCK_TOKENS * per_token
    if cfg.kv_cache_memory_bytes < need:
        raise InvalidArgumentError(
            f"kv_cache_memory_bytes {cfg.kv_cache_memory_bytes} cannot hold one sequence of "
            f"max_model_len {cfg.max_model_len}: that needs {need} bytes ({per_token} per token)")


def build_llm(cfg: RolloutConfig, path: str, seed: int) -> Any:
    """An in-process vLLM ``LLM`` over the model directory ``path`` with ``cfg``'s settings.

    Raises what :func:`check_model_dir` raises, and InvalidArgumentError when the directory
    does not load. Shared by :class:`VLLMRollout` and :class:`podium.rollout.engine.EngineLoop`.
    """
    check_model_dir(cfg, path)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in THIS process
    # vLLM's INFO lines (a dozen per engine) would flood the controller's terminal.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        from vllm import LLM

        kwargs: dict[str, Any] = dict(model=path, tokenizer=path, dtype=cfg.dtype, enforce_eager=True,
                                      max_model_len=cfg.max_model_len, seed=seed,
                                      kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
                                      tensor_parallel_size=1, logprobs_mode="processed_logprobs")
        if _on_gpu():
            kwargs["enable_sleep_mode"] = True
        return LLM(**kwargs)
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds; say which model
        cleanup_vllm_process_state()  # a half-built engine leaves its process groups behind
        raise InvalidArgumentError(f"model directory {path!r} does not load in vLLM: "
                                   f"{type(exc).__name__}: {exc}") from exc


def load_into_engine(llm: Any, items: list) -> None:
    """Load ``(name, tensor)`` pairs (the whole model, Hugging Face names) into ``llm`` in
    place with vLLM's ``reload_weights``, then reset the prefix cache (it holds KV of the old
    weights)."""
    # collective_rpc runs the worker's reload_weights in this process (in-process engine),
    # so the tensors are read where they are: no serialisation.
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    reload_log.addFilter(_quiet_derived_layers)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
    finally:
        reload_log.removeFilter(_quiet_derived_layers)
    llm.reset_prefix_cache()


class VLLMRollout(Worker):
    """A vLLM engine per rank: generation with ``n`` samples and log-probs, weight sync.

    ``config`` is a :class:`RolloutConfig` or a dict of its fields (model directory,
    sampling settings, ``kv_cache_memory_bytes``). The engine is built by
    :meth:`init_model`, not here, so a bad model directory is an error of that call and
    the worker stays up to be told a good one.
    """

    def __init__(self, config: RolloutConfig | dict) -> None:
        super().__init__()
        self.config = RolloutConfig.from_value(config)
        self.llm: Any = None
        self._expected: dict[str, tuple[int, ...]] = {}
        # Buckets of a refs update are staged by the endpoint, checked against the model table.
        self.weights_in = WeightEndpoint(f"rank {self.rank}", lambda pairs: self._load(self._engine(), pairs),
                                         check=lambda pairs, complete: check_weights(pairs, self._expected, complete))
        self._pad_id = 0
        self._said_no_sleep = False
        self._asleep = False

    # ------------------------------------------------------------------ engine

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, model_path: str | None = None) -> dict:
        """Build the engine from ``model_path`` (default: the config's); replaces an earlier one.

        Raises InvalidArgumentError when the directory is missing or does not load, or
        when ``kv_cache_memory_bytes`` cannot hold one sequence of ``max_model_len``.
        Returns :meth:`engine_info` plus ``build_s``.
        """
        path = str(model_path if model_path is not None else self.config.model_path)
        check_model_dir(self.config, path)  # before the old engine goes: a bad path keeps it
        self._shutdown_engine()
        start = time.monotonic()
        llm = build_llm(self.config, path, seed=self.config.seed + self.rank)
        self.llm = llm
        self._expected = expected_weight_shapes(path)
        tok = llm.get_tokenizer()
        self._pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self._model_path = path
        info = self.engine_info()
        info["build_s"] = time.monotonic() - start
        return info

    def _shutdown_engine(self) -> None:
        """Stop the engine (if any) and undo its process-wide state, so a new one can be built."""
        llm, self.llm = self.llm, None
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()
            del llm, core
        cleanup_vllm_process_state()

    def _engine(self) -> Any:
        if self.llm is None:
            raise FailedPreconditionError("the rollout engine is not built: call init_model first")
        return self.llm

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_info(self) -> dict:
        """``{"rank", "pid", "ready", "model_path", "max_model_len", "n", "max_tokens", "weights",
        "device", "asleep"}``."""
        return {"rank": self.rank, "pid": os.getpid(), "ready": self.llm is not None,
                "model_path": getattr(self, "_model_path", None), "max_model_len": self.config.max_model_len,
                "n": self.config.n, "max_tokens": self.config.max_tokens, "weights": len(self._expected),
                "device": "cuda" if self.llm is not None and _on_gpu() else "cpu", "asleep": self._asleep}

    # ------------------------------------------------------------------ generation

    def _sampling_params(self, n: int) -> Any:
        from vllm import SamplingParams

        cfg = self.config
        return SamplingParams(n=n, max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                              top_k=cfg.top_k, ignore_eos=cfg.ignore_eos, logprobs=0, detokenize=False)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """``config.n`` samples for each prompt row (``meta_info["n"]`` overrides it).

        Input: ``input_ids`` (B, P) left-padded with ``attention_mask`` (B, P), or
        ``non_tensor_batch["raw_prompt_ids"]`` (lists of ids). Output: B*n rows, the
        samples of prompt i at rows ``i*n .. i*n+n-1``; fields and dtypes in
        :func:`podium.rollout.outputs.build_output`.
        """
        llm = self._engine()
        if self._asleep:
            raise FailedPreconditionError("the rollout engine is asleep: call wake_up first")
        if not isinstance(prompts, DataProto):
            raise InvalidArgumentError(f"generate_sequences takes a DataProto, got {type(prompts).__name__}")
        n = prompts.meta_info.get("n", self.config.n) if prompts.meta_info else self.config.n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise InvalidArgumentError(f"meta_info['n'] must be an int in [1, 256], got {n!r}")
        token_lists = prompt_token_lists(prompts)
        limit = self.config.max_model_len - self.config.max_tokens
        for row, ids in enumerate(token_lists):
            if not ids:
                raise InvalidArgumentError(f"prompt row {row} is empty")
            if len(ids) > limit:
                raise InvalidArgumentError(
                    f"prompt row {row} has {len(ids)} tokens; with max_tokens {self.config.max_tokens} it "
                    f"needs at most {limit} to fit the model's context max_model_len "
                    f"{self.config.max_model_len}")
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in token_lists],
                               sampling_params=self._sampling_params(n), use_tqdm=False)
        # No per-rank timings in meta_info: the concat of the ranks' outputs needs equal values.
        return build_output(prompts, token_lists, outputs, n=n, max_tokens=self.config.max_tokens,
                            pad_id=self._pad_id)

    # ------------------------------------------------------------------ weights

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_weights(self, source: str | None = None, weights: Mapping[str, Any] | None = None,
                       bucket: Any = None, finish: bool = True) -> dict:
        """Load new weights into the engine in place; later generations follow them.

        Exactly one of:

        * ``source="actor"``: the state dict of the role ``actor`` colocated in this process
          (taken by reference, no copy through the controller or disk);
        * ``weights={name: tensor}``: tensors sent with the call (small models, tests);
        * ``bucket=ObjectRef``: one bucket (``{name: tensor}``) held by an actor worker in
          another process; the worker host fetches it from its owner over Podium's data
          path before this runs (see :func:`podium.rollout.sync.push_weights`). Buckets are
          staged until a call with ``finish=True`` loads them all; a bad one drops the stage.

        Names and shapes must match the model, and the update must cover all of it
        (InvalidArgumentError names the first that do not). The prefix cache is reset.
        Returns ``{"tensors", "bytes", "load_s", "fetch_s", "staged"}``.
        """
        llm = self._engine()
        if self._asleep:
            raise FailedPreconditionError("the rollout engine is asleep: call wake_up before update_weights")
        given = [x is not None for x in (source, weights, bucket)]
        if sum(given) != 1:
            raise InvalidArgumentError("update_weights takes exactly one of source=, weights=, bucket=")
        fetch_s = 0.0
        if bucket is None:
            self.weights_in.refs.finalize()  # a whole-model update drops a half-done bucketed one
        if source is not None:
            if not isinstance(source, str):
                raise InvalidArgumentError(f"source must be a role name, got {type(source).__name__}")
            items = check_weights(sibling_state_dict(self, source).items(), self._expected)
        elif weights is not None:
            if not isinstance(weights, Mapping):
                raise InvalidArgumentError(f"weights must be a dict of name -> tensor, got {type(weights).__name__}")
            items = check_weights(weights.items(), self._expected)
        else:
            from podium.refs import ObjectRef

            start = time.monotonic()
            # The worker host resolves a top-level ref before the call (fetched from its owner);
            # a ref nested elsewhere is fetched here.
            value = bucket.get(timeout=_FETCH_TIMEOUT_S) if isinstance(bucket, ObjectRef) else bucket
            fetch_s = time.monotonic() - start
            # A bad bucket spoils the sync (the next one starts afresh); with finish, the staged
            # buckets together must be the whole model.
            staged = self.weights_in.stage(value, finish)
            if staged is None:
                return {"tensors": self.weights_in.refs.staged, "bytes": 0, "load_s": 0.0, "fetch_s": fetch_s,
                        "staged": True}
            items = staged
        start = time.monotonic()
        self._load(llm, items)
        return {"tensors": len(items), "bytes": sum(t.numel() * t.element_size() for _, t in items),
                "load_s": time.monotonic() - start, "fetch_s": fetch_s, "staged": False}

    def _load(self, llm: Any, items: list) -> None:
        load_into_engine(llm, items)

    # ------------------------------------------------------------------ sleep mode

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, level: int = 1) -> bool:
        """Release the KV cache (level 1: weights to host memory; level 2: weights dropped)
        on GPU; True when it slept. On CPU a no-op (False), said once in the log."""
        if level not in (1, 2):
            raise InvalidArgumentError(f"sleep level must be 1 or 2, got {level!r}")
        llm = self._engine()
        if not _on_gpu():
            self._say_no_sleep()
            return False
        if not self._asleep:
            llm.sleep(level=level)
            self._asleep = True
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def wake_up(self) -> bool:
        """Restore what :meth:`sleep` released (GPU); True when it woke. On CPU a no-op."""
        llm = self._engine()
        if not _on_gpu():
            self._say_no_sleep()
            return False
        if self._asleep:
            llm.wake_up()
            self._asleep = False
        return True

    def _say_no_sleep(self) -> None:
        if not self._said_no_sleep:
            self._said_no_sleep = True
            log.warning("rollout rank %d: sleep/wake_up do nothing on CPU (vLLM sleep mode is GPU only)",
                        self.rank)
