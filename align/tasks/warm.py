"""The built-in tasks' supervised warm start: one loop for every task (AdamW, a linear warm-up then decay, grad clip
1.0, cross-entropy on the labelled tokens), the task supplying its examples."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

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
