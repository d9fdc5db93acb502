"""Warnings for a run whose settings do not fit its model, each said once in the log (never an error):

- most of a step's completions cut at ``--max-tokens`` (``truncated_frac`` > ``CUT_FRAC``): the reward then scores
  unfinished answers, and a real model needs hundreds of tokens (TRL's default is 256);
- a learning rate far outside the usual range for a model of this size (a user's checkpoint of
  >= ``LARGE_PARAMS`` parameters: GRPO recipes for 0.5B-8B models use ~1e-6 for full fine-tuning, ~1e-5 to 2e-4
  for LoRA), e.g. the built-in toy task's 5e-4 used on a 0.5B model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CUT_FRAC = 0.5
LARGE_PARAMS = 10**8
LR_RANGE = {"full": (1e-8, 1e-4), "lora": (1e-7, 1e-3)}  # (low, high): warn outside; usual 1e-6 / 1e-5..2e-4


def truncation_warning(record: dict) -> str | None:
    """The warning for a step record whose completions were mostly cut at ``--max-tokens``, else None."""
    frac = record.get("truncated_frac")
    if not isinstance(frac, (int, float)) or frac <= CUT_FRAC:
        return None
    return (
        f"{frac:.0%} of step {record.get('step', '?')}'s completions were cut at --max-tokens (not finished): the "
        "rewards score unfinished answers; raise --max-tokens (a real model needs hundreds of tokens; TRL's "
        "default is 256)"
    )


def estimated_params(model_dir: str | Path) -> int | None:
    """Parameters of an HF checkpoint from its ``config.json`` (an estimate: embeddings + per layer 4 h^2 of attention
    and 3 h I of MLP, I = ``intermediate_size`` or 4 h), None if unreadable."""
    try:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        h, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
        inter = int(c.get("intermediate_size") or 4 * h)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return vocab * h + layers * (4 * h * h + 3 * h * inter)


def lr_warning(lr: float, lora: bool, model_dir: str | Path) -> str | None:
    """The warning for ``--lr`` far outside the usual range on a large user checkpoint, else None."""
    n = estimated_params(model_dir)
    if n is None or n < LARGE_PARAMS or (Path(model_dir) / "align_tokenizer.json").exists():  # small / built-in
        return None
    low, high = LR_RANGE["lora" if lora else "full"]
    if low <= lr <= high:
        return None
    usual = "1e-5 to 2e-4 with LoRA" if lora else "about 1e-6 for full fine-tuning"
    return (
        f"--lr {lr:g} is far outside the usual range for a {n / 1e9:.1f}B-parameter model ({usual}, as TRL's and "
        "verl's GRPO recipes use, and align's default)"
    )


def warn_once(key: str, text: str | None, said: set[str]) -> None:
    if text is not None and key not in said:
        said.add(key)
        log.warning(text)


def check_lr(cfg: Any, model_dir: str | Path, said: set[str]) -> None:
    warn_once("lr", lr_warning(cfg.lr, cfg.lora.enabled, model_dir), said)
