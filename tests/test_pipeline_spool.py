"""--max-async-steps with the real vLLM worker (CPU build, .venv-rollout) behind the spool: the producer queues a
weight sync per version and the worker stamps every answer, so the rollouts of step t come from version
max(0, t-1-K) exactly, and the pinned eval epochs on the same engine measure one version each (ratio 0)."""

from __future__ import annotations

import json

import pytest
from helpers_models import require_rollout_venv
from helpers_train import spool_cfg

from align.tasks import reverse
from align.train import TrainConfig, train

pytestmark = [pytest.mark.rollout, pytest.mark.slow]

K = 2


def test_async_spool_rollouts_and_pinned_eval_with_the_real_worker(tmp_path, reverse_model):
    require_rollout_venv()
    tok = reverse.tokenizer()
    model = reverse_model
    # max_inflight_requests 8: two groups per request: the batch is split, groups never are
    cfg = spool_cfg(tmp_path / "run", steps=5, warmup_steps=0, max_async_steps=K, max_inflight_requests=8)
    cfg.eval.eval_interval = 2
    cfg.eval.eval_n = 2
    summary = train(
        cfg,
        model=str(model),
        tokenizer=tok,
        prompts=reverse.prompts(16, "train"),
        reward=lambda prompt, completion, **_: completion.count("a") / 6,
        eval_prompts=reverse.prompts(6, "eval"),
    )
    assert summary["steps"] == 5
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if "reward_mean" in r]
    evals = [r for r in recs if "eval/step" in r]
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4, 5]
    for r in train_recs:  # the worker's stamps (checked per completion by the trainer too) follow the rule
        assert r["async/off_policy_steps_max"] == r["async/off_policy_steps_mean"] == min(r["step"] - 1, K)
    assert sorted(r["step"] for r in evals) == [0, 2, 4, 5]
    for r in evals:
        assert r["eval/weight_version"] == r["step"] and r["eval/mixed_version_ratio"] == 0.0
    # the weights did move (else every version would be the same policy and the pin would be vacuous)
    assert train_recs[0]["grad_norm"] > 0
    snaps = sorted(p.name for p in (tmp_path / "run" / "rollout_snapshots").iterdir())
    assert snaps == ["v5"]  # every older snapshot was deleted once no work referenced it


def test_a_worker_killed_mid_pipeline_fails_fast_and_the_rerun_resumes(tmp_path, reverse_model):
    """kill -9 of the worker while the producer is ahead of the trainer: WorkerDiedError reaches train() within the
    client's liveness check (no hang on the producer thread), the last committed checkpoint stays, a rerun resumes."""
    import os
    import signal
    import time

    from align.rollout.client import WorkerDiedError
    from align.rollout.spool import Spool

    require_rollout_venv()
    tok = reverse.tokenizer()
    model = reverse_model
    out = tmp_path / "run"

    def cfg() -> TrainConfig:
        return spool_cfg(out, steps=6, warmup_steps=0, checkpoint_every=2, max_async_steps=1)

    calls = []

    def killing_reward(prompt, completion, **_):
        calls.append(1)
        if len(calls) == 3 * 16 + 1:  # scoring the batch of step 4: the worker dies before step 5 is generated
            os.killpg(Spool(out / "spool").read_heartbeat()["pid"], signal.SIGKILL)
        return completion.count("a") / 6

    prompts = reverse.prompts(16, "train")
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError):
        train(cfg(), model=str(model), tokenizer=tok, prompts=prompts, reward=killing_reward)
    assert time.monotonic() - t0 < 600  # well within --rollout-timeout-s: the dead process is noticed at once
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")) == ["step_2"]
    summary = train(cfg(), model=str(model), tokenizer=tok, prompts=prompts, reward=lambda p, c, **_: c.count("a") / 6)
    assert summary["steps"] == 6
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
