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
    cfg = TrainConfig(
        out=str(tmp_path / "run"),
        steps=3,
        prompts_per_step=4,
        group_size=4,
        max_tokens=6,
        lr=1e-2,
        rollout="spool",
        rollout_in_process=True,
        rollout_timeout_s=600,
        checkpoint_every=0,
    )
    cfg.eval.eval_interval = 0
    prompts = reverse.prompts(16, "train")
    summary = train(
        cfg,
        model=str(model),
        tokenizer=tok,
        prompts=prompts,
        reward=lambda prompt, completion, **_: completion.count("a") / 6,
    )  # dense: learnable from scratch
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


def test_episodes_on_the_spool_worker_train_on_what_vllm_sampled(tmp_path):
    """Multi-turn episodes on the real vLLM worker: each episode submits its next turn as its own request (prompt +
    every earlier turn's sampled ids + the environment's ids). The trainer's teacher-forced recompute of every policy
    token across the turns matches vLLM's logprobs (rho ~1), so the ids trained on are the ids sampled."""
    require_rollout_venv()
    import sys
    from pathlib import Path

    from align.envs.config import EnvConfig

    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
    import turn_envs

    tok = reverse.tokenizer()
    model = save_pretrained(Transformer(reverse.model_config(tok)).init_weights(std=0.2, seed=0), tmp_path / "base")
    cfg = TrainConfig(out=str(tmp_path / "run"), steps=2, prompts_per_step=3, group_size=4, max_tokens=6, lr=1e-2,
                      rollout="spool", rollout_in_process=True, rollout_timeout_s=600, checkpoint_every=0,
                      envs=EnvConfig(max_turns=3))  # fmt: skip
    cfg.eval.eval_interval = 0
    summary = train(cfg, model=str(model), tokenizer=tok, prompts=reverse.prompts(16, "train"), env=turn_envs.Feedback)
    assert summary["steps"] == 2
    recs = [r for r in (json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]
    assert [r["step"] for r in recs] == [1, 2]
    assert any(r["env/env_tokens_mean"] > 0 and r["env/turns_mean"] > 1 for r in recs)  # real later turns
    for r in recs:
        assert r["mismatch_abs_max"] < MISMATCH_TOL, r["mismatch_abs_max"]


@pytest.mark.slow
def test_resume_attached_to_a_running_worker_samples_the_resumed_weights(tmp_path):
    """--no-spawn-worker: the worker keeps whatever it loaded last (here: the base model again, as after a
    restart or another user's sync). The resumed run must sync its checkpoint before step 1 of the rerun,
    or the rollouts come from the wrong policy and the sampler/trainer logprobs disagree."""
    require_rollout_venv()
    import torch

    from align.model import load_pretrained
    from align.rollout.client import make_rollout_client, spawn_worker
    from align.rollout.native import generate
    from align.rollout.protocol import SamplingParams

    tok = reverse.tokenizer()
    mcfg = reverse.model_config(tok)
    base = save_pretrained(Transformer(mcfg).init_weights(seed=0), tmp_path / "base")
    spool = tmp_path / "spool"
    worker = spawn_worker(
        spool,
        model=base,
        weights_version=0,
        log_path=tmp_path / "worker.log",
        in_process=True,
        max_model_len=mcfg.max_position_embeddings,
        dtype="float32",
    )
    prompts = reverse.prompts(16, "train")

    def run(steps: int) -> None:
        cfg = TrainConfig(
            out=str(tmp_path / "run"),
            steps=steps,
            prompts_per_step=4,
            group_size=4,
            max_tokens=6,
            lr=1e-2,
            rollout="spool",
            spool=str(spool),
            spawn_worker=False,
            checkpoint_every=1,
            rollout_timeout_s=600,
        )
        cfg.eval.eval_interval = 0
        train(
            cfg,
            model=str(base),
            tokenizer=tok,
            prompts=prompts,
            reward=lambda prompt, completion, **_: completion.count("a") / 6,
        )

    try:
        run(1)
        make_rollout_client("spool", spool=spool, timeout_s=600, worker=worker).sync_weights(base, 0)  # stale
        run(2)
    finally:
        worker.shutdown(grace_s=5)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[1]["mismatch_abs_max"] < MISMATCH_TOL, recs[1]["mismatch_abs_max"]
    # negative control: the base and the step-1 policy differ by far more than the tolerance on these prompts,
    # so sampling step 2 on the stale base weights would have failed the check above
    step1 = load_pretrained(tmp_path / "run" / "checkpoints" / "step_1" / "model")
    ids = [tok.encode(p["prompt"]) for p in prompts[:4]]
    comps = generate(step1, ids, SamplingParams(n=2, max_tokens=6, seed=0))
    base_model, diffs = load_pretrained(base), []
    for c in comps:
        seq = torch.tensor([ids[c.prompt_index] + c.token_ids])  # (1, L)
        with torch.no_grad():
            a, b = (
                torch.log_softmax(m(seq[:, :-1]), -1).gather(-1, seq[:, 1:, None])[0, :, 0] for m in (step1, base_model)
            )
        diffs.append(float((a - b)[-len(c.token_ids) :].abs().max()))
    assert max(diffs) > 10 * MISMATCH_TOL, diffs
