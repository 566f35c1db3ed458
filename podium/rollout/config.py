"""What a rollout role is built from, validated before any engine starts.

:class:`RolloutConfig` holds the model directory, the sampling settings and the memory
budget of a :class:`podium.rollout.vllm.VLLMRollout`. Every count a caller sets has a
bound, so a typo (``n=10**6``) is an :class:`InvalidArgumentError` at once, not an
engine that tries to allocate it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from podium.errors import InvalidArgumentError

__all__ = ["RolloutConfig", "MAX_SAMPLES", "MAX_NEW_TOKENS", "MAX_MODEL_LEN", "kv_bytes_per_token"]

#: Bounds of what a caller may ask for.
MAX_SAMPLES = 256
MAX_NEW_TOKENS = 32768
MAX_MODEL_LEN = 1 << 20
_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Settings of one rollout engine (the same on every rank).

    ``kv_cache_memory_bytes`` is required: vLLM's default takes ~90% of memory.
    ``n`` samples per prompt (a GRPO group), at most ``max_tokens`` new tokens each.
    ``seed`` seeds the engine (rank ``r`` uses ``seed + r`` so ranks differ).
    ``ignore_eos`` keeps sampling past ``</s>`` (fixed-length responses).
    """

    model_path: str
    kv_cache_memory_bytes: int
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    max_model_len: int = 128
    dtype: str = "float32"
    seed: int = 0
    #: Bytes per bucket when weights come over the data path (cross-process sync).
    bucket_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"RolloutConfig: {msg}")

        if not isinstance(self.model_path, (str, os.PathLike)) or not str(self.model_path):
            raise bad(f"model_path must be a directory path, got {self.model_path!r}")
        for name, low, high in (("n", 1, MAX_SAMPLES), ("max_tokens", 1, MAX_NEW_TOKENS),
                                ("max_model_len", 2, MAX_MODEL_LEN), ("kv_cache_memory_bytes", 1, 1 << 50),
                                ("bucket_bytes", 1 << 10, 1 << 34)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise bad(f"{name} must be an int in [{low}, {high}], got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**31:
            raise bad(f"seed must be an int in [0, 2**31), got {self.seed!r}")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not (self.top_k == -1 or self.top_k >= 1):
            raise bad(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.dtype not in _DTYPES:
            raise bad(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_tokens >= self.max_model_len:
            raise bad(f"max_tokens {self.max_tokens} leaves no room for a prompt in max_model_len "
                      f"{self.max_model_len}")

    @classmethod
    def from_value(cls, value: "RolloutConfig | dict[str, Any]") -> "RolloutConfig":
        """A RolloutConfig from itself or a dict of its fields (unknown keys refused)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidArgumentError(f"rollout config must be a RolloutConfig or dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidArgumentError(f"RolloutConfig: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the engine's dtype."""
        return _DTYPES[self.dtype]


def kv_bytes_per_token(model_path: str, dtype_bytes: int) -> int:
    """KV-cache bytes one token takes in the model at ``model_path`` (from config.json):
    2 (K and V) x layers x kv heads x head size x dtype bytes."""
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes
