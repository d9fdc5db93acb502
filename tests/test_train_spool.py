"""GRPO end to end with --rollout spool: the real vLLM worker (CPU build, .venv-rollout) generates, the
trainer publishes a snapshot every step and the worker reloads it. On-policy at T=1 the sampler's
logprobs and the trainer's recompute agree, so the reported mismatch (rho) is ~1."""

from __future__ import annotations

import json

import pytest
from helpers_models import require_rollout_venv

from align.model import Transformer, save_pretrained
from align.tasks import reverse
from align.train import TrainConfig, train

pytestmark = pytest.mark.rollout

MISMATCH_TOL = 1e-3  # |log pi_old - log mu| per token, fp32 vLLM CPU vs align (measured ~1e-5)




def test_grpo_with_spool_rollout(tmp_path):
    require_rollout_venv()
    tok = reverse.tokenizer()
    model = save_pretrained(Transformer(reverse.model_config(tok)).init_weights(seed=0), tmp_path / "base")
    cfg = TrainConfig(out=str(tmp_path / "run"), steps=3, prompts_per_step=4, group_size=4, max_tokens=6, lr=1e-2,
                      rollout="spool", rollout_in_process=True, rollout_timeout_s=600, checkpoint_every=0)
    cfg.eval.eval_interval = 0
    prompts = reverse.prompts(16, "train")
    summary = train(cfg, model=str(model), tokenizer=tok, prompts=prompts,
                    reward=lambda prompt, completion, **_: completion.count("a") / 6)  # dense: learnable from scratch
    assert summary["steps"] == 3
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["sync_time"] > 0  # a snapshot was published and reloaded after every step
        assert r["mismatch_abs_max"] < MISMATCH_TOL, r["mismatch_abs_max"]
    # the updates were real: a different policy after step 1 means the worker must have reloaded weights,
    # else the rollouts of later steps would still match the base model's logprobs and the mismatch would grow
    assert recs[0]["grad_norm"] > 0
    assert not any(p.is_dir() for p in (tmp_path / "run").iterdir() if p.name.startswith("spool-proc"))
