"""align.run.advice: a run whose completions are mostly cut at --max-tokens, or whose lr is far outside the usual
range for its (large, user) checkpoint, says so once in the log (a warning, never an error)."""

from __future__ import annotations

import json
import logging

from align.run.advice import lr_warning, truncation_warning
from align.run.log import MetricsLog

QWEN_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "vocab_size": 151936,
}  # Qwen2.5-0.5B's shape
TINY = {"hidden_size": 128, "num_hidden_layers": 2, "vocab_size": 293}  # examples/own_data/make_tiny.py's


def model_dir(tmp_path, shape: dict):
    d = tmp_path / str(shape["hidden_size"])
    d.mkdir()
    (d / "config.json").write_text(json.dumps(shape))
    return d


def test_the_issue_run_warns_about_its_toy_lr(tmp_path):
    big = model_dir(tmp_path, QWEN_05B)
    msg = lr_warning(5e-4, False, big)  # the built-in task's default on a 0.5B checkpoint
    assert msg is not None and "--lr 0.0005" in msg and "0.5B" in msg
    assert lr_warning(1e-6, False, big) is None  # negative controls: TRL's lr, LoRA's usual lr, a tiny model
    assert lr_warning(1e-4, True, big) is None
    assert lr_warning(3e-3, False, model_dir(tmp_path, TINY)) is None


def test_mostly_cut_completions_warn_once(tmp_path, caplog):
    assert truncation_warning({"step": 1, "truncated_frac": 0.3}) is None  # negative control
    log = MetricsLog(tmp_path / "metrics.jsonl")
    with caplog.at_level(logging.WARNING, logger="align.run.advice"):
        log.write({"step": 1, "truncated_frac": 0.97})
        log.write({"step": 2, "truncated_frac": 0.99})
    said = [r.getMessage() for r in caplog.records if r.name == "align.run.advice"]
    assert len(said) == 1 and "97% of step 1's completions were cut at --max-tokens" in said[0]
