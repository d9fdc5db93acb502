"""LoRA with the real vLLM worker (CPU build, .venv-rollout): adapter-only weight sync.

The worker runs on the base checkpoint with ``--max-lora-rank``; each sync of an align-written PEFT adapter
becomes a new ``LoRARequest`` (no engine rebuild, no base reload) and stamps later completions with its
version. Reference: align's teacher-forced logprobs of the same LoRA model.
Without .venv-rollout these tests skip, or fail under ALIGN_REQUIRE_ROLLOUT=1 (scripts/test.sh).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_models import make_tiny_qwen2, require_rollout_venv

from align import lora
from align.model import load_pretrained
from align.rollout.client import RolloutError, make_rollout_client, spawn_worker
from align.rollout.protocol import SamplingParams

pytestmark = pytest.mark.rollout

LOGPROB_TOL = 1e-4  # fp32 vLLM CPU (LoRA kernels) vs align's teacher-forced logprobs
MISMATCH_TOL = 1e-3  # |log pi_old - log mu| per token in the training loop (as tests/test_train_spool.py)
PROMPTS = [[5, 17, 99, 123], [7, 8], [300, 2, 44, 45, 46, 47]]


def teacher_forced(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1]  # (len(completion), V)
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def max_diff(model, comps) -> float:
    return max(
        abs(a - b)
        for c in comps
        for a, b in zip(c.logprobs, teacher_forced(model, PROMPTS[c.prompt_index], c.token_ids))
    )


def adapter(base: Path, out: Path, seed: int, rank: int = 8):
    model = load_pretrained(base)
    lora.apply_lora(model, lora.LoraConfig(rank=rank, alpha=16.0), base_model=base, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
    lora.save_adapter(model, out)
    return model


def test_vllm_serves_align_adapters_with_align_logprobs(tmp_path):
    require_rollout_venv()
    base = make_tiny_qwen2(tmp_path / "base", seed=0)
    m1, m2 = adapter(base, tmp_path / "a1", seed=1), adapter(base, tmp_path / "a2", seed=2)
    adapter(base, tmp_path / "r16", seed=3, rank=16)
    handle = spawn_worker(
        tmp_path / "spool",
        model=base,
        log_path=tmp_path / "worker.log",
        max_model_len=256,
        dtype="float32",
        in_process=True,
        extra_args=["--max-lora-rank", "8"],
        ready_timeout_s=300,
    )
    try:
        client = make_rollout_client("spool", spool=tmp_path / "spool", timeout_s=180, worker=handle)
        params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3)
        client.sync_weights(tmp_path / "a1", 1)
        assert client.last_timings["sync_method"] == "lora"
        comps = client.generate(PROMPTS, params)
        assert {c.weights_version for c in comps} == {1}
        assert max_diff(m1, comps) <= LOGPROB_TOL
        assert max_diff(load_pretrained(base), comps) > LOGPROB_TOL * 10  # negative control: the adapter is served
        client.sync_weights(tmp_path / "a2", 2)  # a new LoRARequest; the old one is dropped
        comps = client.generate(PROMPTS, params)
        assert {c.weights_version for c in comps} == {2}
        assert max_diff(m2, comps) <= LOGPROB_TOL
        assert max_diff(m1, comps) > LOGPROB_TOL * 10  # negative control: not the previous adapter
        with pytest.raises(RolloutError, match="rank 16"):
            client.sync_weights(tmp_path / "r16", 3)
        assert {c.weights_version for c in client.generate(PROMPTS[:1], params)} == {2}  # still serving v2
    finally:
        handle.shutdown(grace_s=5)
    log = (tmp_path / "worker.log").read_text()
    assert log.count("engine up") == 1, "adapter sync must not rebuild the engine"


def test_grpo_with_adapter_only_sync(tmp_path, reverse_model):
    from helpers_train import spool_cfg

    from align.tasks import reverse
    from align.train import train

    require_rollout_venv()
    tok = reverse.tokenizer()
    model = reverse_model
    cfg = spool_cfg(tmp_path / "run", steps=3, lr=5e-2, lora={"rank": 8, "alpha": 16.0})
    summary = train(cfg, model=str(model), tokenizer=tok, prompts=reverse.prompts(16, "train"),
                    reward=lambda prompt, completion, **_: completion.count("a") / 6)  # fmt: skip
    assert summary["steps"] == 3
    run = tmp_path / "run"
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["grad_norm"] > 0
    for r in recs:
        assert r["sync_time"] > 0
        assert r["mismatch_abs_max"] < MISMATCH_TOL, r["mismatch_abs_max"]  # the worker served each new adapter
    snaps = list((run / "rollout_snapshots").iterdir())
    assert [s.name for s in snaps] == ["v3"]
    assert sorted(f.name for f in snaps[0].iterdir()) == [
        ".complete",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    log = (run / "rollout_worker.log").read_text()
    assert log.count("as LoRA") == 4 and log.count("engine up") == 1  # v0 + 3 steps, one engine
    ckpt = run / "checkpoints" / "step_3"
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and not (ckpt / "model").exists()


def test_eval_fleet_serves_adapter_snapshots(tmp_path, builtin_model_30):
    """LoRA + --eval-num-gpus: each eval snapshot is the adapter (+ its base named inside); the fleet's engines run
    the base model with LoRA enabled and pin each adapter; the final point equals align's own score of it."""
    from helpers_train import fleet_eval_config, greedy_eval, partial_credit

    from align.tasks import reverse
    from align.train import TrainConfig, train

    require_rollout_venv()
    base = builtin_model_30  # the reverse task after a 30-step warm start (tests/conftest.py)
    tok = reverse.tokenizer()
    eval_prompts = reverse.prompts(24, "eval", 0)
    eval_cfg = fleet_eval_config(tmp_path, keep=1)
    cfg = TrainConfig(out=str(tmp_path / "run"), steps=4, prompts_per_step=8, group_size=4, checkpoint_every=0,
                      lr=2e-2, eval=eval_cfg, lora={"rank": 8, "alpha": 16.0}, max_tokens=10,
                      loss={"eps_high": 0.2})  # fmt: skip
    train(cfg, model=str(base), tokenizer=tok, prompts=reverse.prompts(200, "train", 0), reward=partial_credit,
          eval_prompts=eval_prompts)  # fmt: skip
    recs = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in recs if "eval/avg@1" in r and r["step"] > 0}
    assert sorted(evals) == [2, 4] and all(r["eval/weight_version"] == s for s, r in evals.items()), recs
    kept = [p for p in (tmp_path / "eval_hf").iterdir() if p.name.startswith("step_")]
    assert [p.name for p in kept] == ["step_4"] and (kept[0] / "adapter_config.json").is_file()
    assert not (kept[0] / "config.json").exists()  # the adapter only, no full snapshot
    assert lora.adapter_base(kept[0]) == str(base)
    native, comps = greedy_eval(lora.load_adapter(load_pretrained(base), kept[0]), tok, eval_prompts, cfg.max_tokens)
    assert evals[4]["eval/avg@1"] == pytest.approx(native["eval/avg@1"], abs=1e-9), (evals[4], native)
    _, base_comps = greedy_eval(load_pretrained(base), tok, eval_prompts, cfg.max_tokens)
    assert [c.token_ids for c in base_comps] != [c.token_ids for c in comps]  # negative control: the adapter matters
