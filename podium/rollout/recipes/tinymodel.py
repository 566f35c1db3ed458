"""Build small random Llama models and a word-level tokenizer offline (no hub access).

The GRPO example, the rollout tests and the bench need a model vLLM can load without
downloading anything: :func:`build_tiny_llama` writes a ``transformers`` Llama with
random weights and a ``tokenizers`` WordLevel tokenizer (wrapped in
``PreTrainedTokenizerFast``) into a directory, which ``vllm.LLM(model=dir)`` and
``AutoModelForCausalLM.from_pretrained(dir)`` both read.

vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and
512 only, so ``hidden_size / num_attention_heads`` must be one of those (checked here).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from podium.errors import InvalidArgumentError

__all__ = ["SPECIAL_TOKENS", "default_words", "build_tiny_llama", "LLAMA_100M"]

#: Special tokens, in id order: pad=0, bos=1, eos=2, unk=3.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")

#: Head sizes vLLM's CPU attention backend accepts.
_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

#: Shape of a ~100M-parameter Llama (the bench's "real-sized" weight-sync case).
LLAMA_100M = dict(vocab_size=32000, hidden_size=640, intermediate_size=1728, num_hidden_layers=10,
                  num_attention_heads=10, num_key_value_heads=10)


def default_words(count: int) -> list[str]:
    """``count`` distinct plain words ``w0 .. w{count-1}`` for the vocabulary."""
    return [f"w{i}" for i in range(count)]


def _build_tokenizer(words: Sequence[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *words])}
    if len(vocab) != len(SPECIAL_TOKENS) + len(words):
        raise InvalidArgumentError("tokenizer words must be distinct and differ from the special tokens")
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def build_tiny_llama(path: str | os.PathLike, *, words: Sequence[str] | None = None, vocab_size: int | None = None,
                     hidden_size: int = 64, intermediate_size: int = 128, num_hidden_layers: int = 2,
                     num_attention_heads: int = 2, num_key_value_heads: int | None = None,
                     max_position_embeddings: int = 256, seed: int = 0,
                     tie_word_embeddings: bool = False) -> str:
    """Write a random Llama and its tokenizer to ``path``; returns ``path`` as a string.

    ``words`` are the tokenizer's plain tokens (default ``w0..w27``, 32 ids with the 4
    special ones). ``vocab_size`` defaults to the tokenizer's size and may be larger
    (ids past the tokenizer decode as nothing; the bench's 100M model uses 32000).
    Weights are ``torch.manual_seed(seed)`` random, saved as safetensors (float32).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    words = list(words) if words is not None else default_words(28)
    n_tokens = len(SPECIAL_TOKENS) + len(words)
    vocab_size = n_tokens if vocab_size is None else int(vocab_size)
    if vocab_size < n_tokens:
        raise InvalidArgumentError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n_tokens} tokens")
    if hidden_size % num_attention_heads or hidden_size // num_attention_heads not in _CPU_HEAD_SIZES:
        raise InvalidArgumentError(
            f"head size hidden_size/num_attention_heads = {hidden_size}/{num_attention_heads} must be one "
            f"of {_CPU_HEAD_SIZES} (vLLM's CPU attention)")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads or num_attention_heads,
                         max_position_embeddings=max_position_embeddings, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=tie_word_embeddings, dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _build_tokenizer(words).save_pretrained(path)
    return str(path)
