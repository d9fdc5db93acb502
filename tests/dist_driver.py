"""Driver of tests/test_dist.py (not a test): ``train()`` on a tiny model, run as one process or under torchrun.

argv[1]: JSON {"cfg": TrainConfig fields, "model": dir, "calls": path, "per_rank_normaliser": bool}. Rank 0 writes
the (prompt, completion) pairs the reward saw, in call order, to "calls"."""

from __future__ import annotations

import json
import sys
import time

import torch

from align import dist
from align.tasks.tokenizer import CharTokenizer
from align.train import TrainConfig, train

TOK = CharTokenizer("abcd=")
PROMPTS = [{"prompt": w + "="} for w in ("ab", "cd", "bca", "dd", "abc", "cab", "dab", "bb")]
CALLS: list[list[str]] = []


HANG = {}


def reward(prompt: str, completion: str, **_) -> float:
    CALLS.append([prompt, completion])
    if HANG and dist.rank() == HANG["rank"] and len(CALLS) > HANG["after_calls"]:
        time.sleep(3600)  # a rank that hangs (tests/test_dist.py: the others must fail within --dist-timeout-s)
    return completion.count("a") / 4


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("per_rank_normaliser"):  # the negative control: each rank divides by its own counts
        dist.reduce_counts = lambda counts: counts
    HANG.update(spec.get("hang", {}))
    cfg = TrainConfig(**spec["cfg"])
    cfg.eval.eval_interval = 0
    cfg.log.log_completions_every = 0
    train(cfg, model=spec["model"], tokenizer=TOK, prompts=PROMPTS, reward=reward)
    if torch.distributed.is_initialized():  # tests/test_dist.py: every torchrun run checks train() ended its group
        sys.exit("train() returned with its process group still initialised")
    if dist.is_main():  # torchrun's RANK once the group is gone
        with open(spec["calls"], "w") as fh:
            json.dump(CALLS, fh)


if __name__ == "__main__":
    main()
