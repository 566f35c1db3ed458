"""``podium.rollout.recipes``: what the examples train with, kept out of the rollout interface.

* :mod:`~podium.rollout.recipes.grpo`: the GRPO actor and reference roles of ``examples/grpo_vllm.py``;
* :mod:`~podium.rollout.recipes.asyncgrpo`: the off-policy trainer of ``examples/grpo_async.py``;
* :mod:`~podium.rollout.recipes.tinymodel`: random Llama models and a tokenizer, built offline.
"""
