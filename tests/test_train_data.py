"""Training on your own data from the Python API and the CLI: JSONL in, a BPE tokenizer with a chat template,
rewards from a file (one times out, one raises), completions.jsonl, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from align.model import Transformer, save_pretrained
from align.tasks import reverse
from align.tasks.tokenizer import CharTokenizer
from align.train import TrainConfig, train

TOK = CharTokenizer("abcd=")
PROMPTS = [{"prompt": w + "="} for w in ("ab", "cd", "bca", "dd")]


def a_reward(prompt: str, completion: str, **_) -> float:
    return completion.count("a") / 4


@pytest.fixture(scope="module")
def char_model(tmp_path_factory) -> str:
    cfg = reverse.model_config(TOK)
    cfg.num_hidden_layers = 1
    return str(save_pretrained(Transformer(cfg).init_weights(seed=0), tmp_path_factory.mktemp("tiny") / "m"))


def records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_python_api_without_eval_prompts_trains_under_the_default_eval_interval(tmp_path, char_model):
    # The module docstring's example: no eval_prompts, the default eval config (eval_interval=10).
    cfg = TrainConfig(out=str(tmp_path / "run"), steps=2, prompts_per_step=2, group_size=2, max_tokens=3)
    assert cfg.eval.eval_interval > 0
    summary = train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    assert summary["steps"] == 2 and summary["eval_start"] is None
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2]
