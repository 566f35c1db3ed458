"""A tiny Llama built offline, with a chat template (verl's datasets and agent loops apply
one to every prompt): the model both verl trainer scenarios run on."""

import json
import os

from podium.rollout.recipes.tinymodel import build_tiny_llama


def build(work: str) -> str:
    """Build the model under ``work``; its folder (model and tokenizer)."""
    model = build_tiny_llama(os.path.join(work, "model"))
    tokenizer_config = os.path.join(model, "tokenizer_config.json")
    with open(tokenizer_config) as f:
        settings = json.load(f)
    settings["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    with open(tokenizer_config, "w") as f:
        json.dump(settings, f)
    return model
