"""The reverse task (``align.tasks.reverse``) on a tiny mixture-of-experts model: ``--task reverse_moe``.

The same words, reward, splits and biased warm start as ``reverse``; the model is a Qwen3-MoE of the dense one's
size (3 layers, hidden 128) whose feed-forward blocks are 8 experts of 128, top-2, so a token's active expert width
(256) is the dense MLP's. Rollout routing replay (``--routing-replay rollout``, R3) is on by default: the learner
runs the experts the sampler chose for each sampled token, and ``moe/*`` metrics are logged every step.
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial

from align.char_tokenizer import CharTokenizer
from align.model import ModelConfig
from align.tasks import reverse, warm
from align.tasks.reverse import Env, prompts, reward, tokenizer, warm_example  # noqa: F401  (TaskModule members, as reverse's)

TRAIN_DEFAULTS: dict = {**reverse.TRAIN_DEFAULTS, "moe.routing_replay": "rollout"}


def model_config(tok: CharTokenizer) -> ModelConfig:
    """The dense task model's shape (context, attention, depth) with Qwen3-MoE blocks: 8 experts of 128, top-2."""
    return dataclasses.replace(
        reverse.model_config(tok),
        model_type="qwen3_moe",
        qkv_bias=False,  # Qwen3: attention_bias false, q/k norm instead
        qk_norm=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
    )


# the steps, batch, lr, seed and log of align.tasks.warm.warm_start: reverse's examples on this module's MoE model
warm_start = partial(warm.warm_start, sys.modules[__name__])


def check_sizes(rows: list[dict], tok: CharTokenizer, max_tokens: int, max_turns: int = 1) -> None:
    """``reverse``'s check: this model has the dense one's context."""
    reverse.check_sizes(rows, tok, max_tokens, max_turns)
