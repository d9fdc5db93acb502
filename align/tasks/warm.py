"""The built-in tasks' supervised warm start: one loop for every task (AdamW, a linear warm-up then decay, grad clip
1.0, cross-entropy on the labelled tokens), the task supplying its examples. ``warm_start(task, path, ...)`` is
every task module's ``warm_start``: the module's model on batches of its ``warm_example(row, tok, rng)``."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from align.model import ModelConfig, Transformer, save_pretrained


def supervised(
    path: str | Path,
    tok: object,
    model_cfg: ModelConfig,
    examples: Callable[[random.Random], list[tuple[list[int], list[int]]]],
    *,
    steps: int,
    lr: float,
    seed: int,
    log: Callable[[str], None] | None,
) -> Path:
    """Train a fresh ``model_cfg`` model for ``steps`` steps on ``examples(rng)`` (a batch of (ids, labels) pairs of
    equal length; ``labels[t]`` is the target after ``ids[:t + 1]``, -100 where nothing is learned) and save it with
    the tokenizer at ``path``."""
    torch.manual_seed(seed)
    model = Transformer(model_cfg).init_weights(seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if steps < 0:
        raise ValueError(f"a warm start needs steps >= 0 (0 = the seeded random weights), got {steps}")
    decay = max(steps, 1)  # steps = 0: no step runs, the schedule is never read
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / decay))
    rng = random.Random(seed)
    for step in range(steps):
        rows = examples(rng)
        B, L = len(rows), max(len(x) for x, _ in rows)
        ids = torch.zeros(B, L, dtype=torch.long)  # (B, L) right-padded
        labels = torch.full((B, L), -100, dtype=torch.long)  # (B, L)
        for i, (x, y) in enumerate(rows):
            ids[i, : len(x)] = torch.tensor(x)
            labels[i, : len(y)] = torch.tensor(y)
        logits = model(ids)  # (B, L, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log and (step % 100 == 0 or step == steps - 1):
            log(f"warm start step {step + 1}/{steps} | loss {loss.item():.3f}")
    path = save_pretrained(model.eval(), path)
    tok.save(path)
    return path


def warm_start(
    task: Any,
    path: str | Path,
    *,
    steps: int = 400,
    batch: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
) -> Path:
    """A task module's warm start (``align.tasks.TaskModule``): a fresh ``task.model_config(tok)`` model trained
    ``steps`` steps on ``batch`` rows a step of 4000 of its training prompts, each made an (ids, labels) pair by
    ``task.warm_example(row, tok, rng)``; saved with the tokenizer at ``path``."""
    tok = task.tokenizer()
    data = task.prompts(4000, "train", seed=seed)
    examples = TaskExamples(task.warm_example, tok, data, batch)
    return supervised(path, tok, task.model_config(tok), examples, steps=steps, lr=lr, seed=seed, log=log)


class TaskExamples:
    """``examples(rng)`` for ``supervised``: ``batch`` rows drawn from ``data``, each made a pair by ``example``."""

    def __init__(self, example: Callable[..., tuple[list[int], list[int]]], tok: Any, data: list, batch: int) -> None:
        self.example, self.tok, self.data, self.batch = example, tok, data, batch

    def __call__(self, rng: random.Random) -> list[tuple[list[int], list[int]]]:
        return [self.example(row, self.tok, rng) for row in rng.sample(self.data, self.batch)]


def longest_prompt(rows: list[dict], tok: Any, max_tokens: int, context: int, task: str) -> int:
    """A task's ``check_sizes`` start: the longest prompt of ``rows`` in tokens, refused (a ``ValueError`` naming
    --max-tokens) when it and ``max_tokens`` do not fit the model's ``context``; ``task`` names the task."""
    longest = max(len(tok.encode(r["prompt"])) for r in rows)
    if longest + max_tokens > context:
        raise ValueError(
            f"--max-tokens {max_tokens}: the {task} task's prompts are up to {longest} tokens and its model's "
            f"context is {context}; --max-tokens can be at most {context - longest}"
        )
    return longest
