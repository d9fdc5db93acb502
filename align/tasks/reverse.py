"""The embedded default task: reverse a string of letters. Reward 1 for the exact reverse, else 0.

Prompt ``"<bos>cabd="``, correct completion ``"dbac<eos>"``. Held-out prompts are disjoint from the
training prompts. The warm start is a short supervised run on a *biased* mixture: 65% of its targets
copy the string instead of reversing it, so the warmed-up model mostly copies and reverses only
about a third of the time. Every point of accuracy beyond that must come from the reward: GRPO
has to find and reinforce the reversing behaviour on its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from align.char_tokenizer import CharTokenizer
from align.model import ModelConfig

ALPHABET = "abcdefgh="
MIN_LEN, MAX_LEN = 3, 6
COPY_FRACTION = 0.65  # the warm start's bias: this share of its targets are copies, not reversals
# the toy's own settings, where TrainConfig's defaults are a real model's (a 9-char tokenizer, ~5-token answers)
TRAIN_DEFAULTS: dict = {"lr": 5e-4, "max_tokens": 10, "loss.eps_high": 0.2}
Env = None  # single-turn: ``reward`` scores the completion


def tokenizer() -> CharTokenizer:
    return CharTokenizer(ALPHABET)


def _random_word(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET[:-1]) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))


def prompts(n: int, split: str, seed: int = 0) -> list[dict]:
    """``n`` distinct prompts as dicts {"prompt", "answer"}. ``split`` is "train" or "eval"; a word is in
    the eval split iff its hash bucket is 0 (of 8), so the splits never share a word."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"{split}-{seed}")
    out, seen = [], set()
    while len(out) < n:
        w = _random_word(rng)
        is_eval = sum(map(ord, w)) * 2654435761 % 2**32 % 8 == 0
        if w in seen or is_eval != (split == "eval"):
            continue
        seen.add(w)
        out.append({"prompt": w + "=", "answer": w[::-1]})
    return out


def reward(prompt: str, completion: str, answer: str | None = None, **_) -> float:
    """1.0 for the exact reverse of the word in ``prompt``, else 0.0."""
    target = answer if answer is not None else prompt.rstrip("=")[::-1]
    return 1.0 if completion == target else 0.0


def model_config(tok: CharTokenizer) -> ModelConfig:
    return ModelConfig(
        model_type="qwen2",
        vocab_size=tok.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        qkv_bias=True,
        max_position_embeddings=32,
        rope_theta=1000.0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def warm_start(
    path: str | Path,
    *,
    steps: int = 400,
    batch: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
) -> Path:
    """Supervised warm start on the biased copy/reverse mixture; saves an HF checkpoint at ``path``."""
    return warm_start_model(model_config(tokenizer()), path, steps=steps, batch=batch, lr=lr, seed=seed, log=log)


def warm_start_model(
    model_cfg: ModelConfig, path: str | Path, *, steps: int, batch: int, lr: float, seed: int, log: Callable | None
) -> Path:
    """``warm_start`` for a model of shape ``model_cfg`` (``align.tasks.reverse_moe``: the same task, MoE)."""
    from align.tasks.warm import supervised

    tok = tokenizer()
    data = prompts(4000, "train", seed=seed)

    def examples(rng: random.Random) -> list[tuple[list[int], list[int]]]:
        rows = []
        for ex in rng.sample(data, batch):
            word = ex["prompt"][:-1]
            target = word if rng.random() < COPY_FRACTION else word[::-1]
            p, c = tok.encode(ex["prompt"]), tok.encode(target, add_bos=False) + [tok.eos_token_id]
            rows.append((p + c, [-100] * (len(p) - 1) + c))  # label t: the token after position t
        return rows

    return supervised(path, tok, model_cfg, examples, steps=steps, lr=lr, seed=seed, log=log)


def check_sizes(rows: list[dict], tok: CharTokenizer, max_tokens: int, max_turns: int = 1) -> None:
    """Before the warm start: the longest prompt + ``max_tokens`` fits the task model's context (one turn, whatever
    ``max_turns``)."""
    context = model_config(tok).max_position_embeddings
    longest = max(len(tok.encode(r["prompt"])) for r in rows)
    if longest + max_tokens > context:
        raise ValueError(
            f"--max-tokens {max_tokens}: the built-in task's prompts are up to {longest} tokens and its model's "
            f"context is {context}; --max-tokens can be at most {context - longest}"
        )
