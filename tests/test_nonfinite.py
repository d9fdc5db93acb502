"""Non-finite numbers are never trained on or committed (issue 30): non-float or NaN/inf weights are refused at load
(model, LoRA adapter, checkpoint), an optimizer step with a non-finite loss or gradient norm is skipped and counted
(``nonfinite_steps``) and the run stops at ``--max-nonfinite-steps`` with its last checkpoint intact, a model holding
NaN is never checkpointed, and a reward float32 cannot hold is an error, not a crash mid-run. Each check has a
negative control that passes the check with the same setup."""

from __future__ import annotations

import json
import logging
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers_train import PROMPTS, TOK, a_reward, cfg_for, records

from align import learner, lora
from align.model import load_pretrained
from align.rewards import FLOAT32_MAX, RewardScorer, load_rewards
from align.run import checkpoint as ckpt
from align.run.cli import parse
from align.train import CLI_PREFIXES, TrainConfig, train

SWAPPED = "model.embed_tokens.weight"


def run(cfg: TrainConfig, model: str, reward=a_reward) -> dict:
    return train(cfg, model=model, tokenizer=TOK, prompts=PROMPTS, reward=reward)


def swap_dtype(path: Path, prefix: str = "") -> str:
    """Rewrite the safetensors header of ``path`` so its first F32 tensor (``prefix`` + ``SWAPPED`` when present)
    reads as I32: same size, so the file still parses. Returns the tensor's name."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = prefix + SWAPPED if prefix + SWAPPED in header else next(k for k in header if k != "__metadata__")
    assert header[name]["dtype"] == "F32"
    header[name]["dtype"] = "I32"
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # same length: the offsets stay valid
    path.write_bytes(data[:8] + raw + data[8 + n :])
    return name


def poison(path: Path, name: str) -> None:
    """Set one value of tensor ``name`` in safetensors file ``path`` to NaN (a valid file, a non-finite weight)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    state[name].view(-1)[0] = math.nan
    save_file(state, str(path), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------ at load


@pytest.mark.parametrize("fault", ["dtype", "nan"])
def test_model_weights_that_are_not_finite_floats_are_named(tmp_path, char_model, fault):
    model = tmp_path / "m"
    shutil.copytree(char_model, model)
    load_pretrained(model)  # negative control: the intact copy loads
    f = model / "model.safetensors"
    name = swap_dtype(f) if fault == "dtype" else SWAPPED
    if fault == "nan":
        poison(f, name)
    want = "is stored as torch.int32" if fault == "dtype" else "holds 1 non-finite value"
    with pytest.raises(ValueError, match=rf"tensor '{name}' in {f} {want}"):
        load_pretrained(model)


def lora_cfg(**kw) -> lora.LoraConfig:
    return lora.LoraConfig(**{"rank": 2, "targets": "q_proj,v_proj", **kw})


@pytest.mark.parametrize("fault", ["dtype", "nan"])
def test_adapter_weights_that_are_not_finite_floats_are_named(tmp_path, char_model, fault):
    policy = lora.apply_lora(load_pretrained(char_model), lora_cfg(), base_model=char_model, seed=0)
    adapter = lora.save_adapter(policy, tmp_path / "adapter")
    lora.load_adapter(load_pretrained(char_model), adapter)  # negative control: the intact adapter loads
    f = Path(adapter) / lora.ADAPTER_WEIGHTS
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        name = next(k for k in json.loads(fh.read(n)) if k != "__metadata__")
    if fault == "dtype":
        swap_dtype(f)
    else:
        poison(f, name)
    want = "is stored as torch.int32" if fault == "dtype" else "holds 1 non-finite value"
    with pytest.raises(ValueError, match=rf"tensor '{name}' in {f} {want}"):
        lora.load_adapter(load_pretrained(char_model), adapter)


def test_infinite_lora_alpha_is_refused():
    assert lora_cfg(alpha=1e30).scaling == 5e29  # large but finite: the step check below handles it
    for alpha in (math.inf, math.nan):
        with pytest.raises(ValueError, match="--lora-alpha must be > 0 and finite"):
            lora_cfg(alpha=alpha)


def test_resume_from_a_checkpoint_with_swapped_dtype_is_named(tmp_path, char_model):
    out = tmp_path / "run"
    run(cfg_for(out, steps=2), char_model)
    step2 = out / "checkpoints" / "step_2"
    ckpt.load_model(step2, torch.float32)  # negative control: the intact checkpoint loads
    f = step2 / "model" / "model.safetensors"
    name = swap_dtype(f)
    with pytest.raises(ckpt.CheckpointError, match=rf"(?s)tensor '{name}' in {f} is stored as torch.int32"):
        run(cfg_for(out, steps=4), char_model)
    assert [d.name for _, d in ckpt.committed(out / "checkpoints")] == ["step_2"]


def test_resume_from_nan_optimizer_state_or_dcp_shards_is_refused(tmp_path, char_model):
    """NaN in a checkpoint's optimizer state (trainer_state.pt) or in a sharded (DCP) checkpoint's weights was
    loaded and trained on (an AdamW moment of NaN makes its parameter NaN at the first step). Both are refused at
    resume, naming the checkpoint and the earlier one to resume from; nothing is written. Controls: the earlier
    checkpoint resumes, and the same DCP checkpoint without the NaN loads."""
    out = tmp_path / "run"
    run(cfg_for(out, steps=2, checkpoint_every=1), char_model)
    f = out / "checkpoints" / "step_2" / "trainer_state.pt"
    state = torch.load(f, weights_only=True)
    next(iter(state["optimizer"]["state"].values()))["exp_avg"].view(-1)[0] = math.nan
    torch.save(state, f)
    with pytest.raises(
        ckpt.CheckpointError, match=r"checkpoint \S*step_2 holds NaN/inf in optimizer state 'exp_avg' of model\.\S+: "
        r"training on from it would spread them; resume from .* --resume-from step_1"
    ):  # fmt: skip
        run(cfg_for(out, steps=4, checkpoint_every=1), char_model)
    assert [d.name for _, d in ckpt.committed(out / "checkpoints")] == ["step_1", "step_2"]
    assert len(records(out)) == 2
    run(cfg_for(out, steps=3, checkpoint_every=1, resume_from="step_1"), char_model)  # control: the earlier one
    assert [r["step"] for r in records(out)][-2:] == [2, 3]

    def sharded(poisoned: bool) -> tuple[Path, dict]:
        m = load_pretrained(char_model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(torch.tensor([[1, 2, 3]])).float().sum().backward()
        opt.step()
        if poisoned:
            with torch.no_grad():
                dict(m.named_parameters())[SWAPPED].view(-1)[0] = math.nan
        d = ckpt.save_sharded(tmp_path / f"dcp{poisoned}", 1, m, opt, {"scheduler": {}, "cursor": {"epoch": 0,
                              "index": 4}}, keep=2)  # fmt: skip
        return d, ckpt.load_state(d)

    for poisoned in (False, True):  # control first: the intact DCP checkpoint loads
        d, state = sharded(poisoned)
        fresh = load_pretrained(char_model)
        opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        if not poisoned:
            ckpt.restore_any(d, state, fresh, opt)
            continue
        with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint \S*step_1 holds NaN/inf in weight {SWAPPED}"):
            ckpt.restore_any(d, state, fresh, opt)


# ------------------------------------------------------------------------------------------------ the step


def test_a_nonfinite_gradient_norm_skips_the_step_and_changes_nothing(char_model):
    """lora_alpha 1e30: the loss is finite (B starts at 0) but the gradient norm overflows float32."""
    from helpers_learner import CPU, batch_for, cfg

    def step(alpha: float, grad_clip: float):
        policy = lora.apply_lora(load_pretrained(char_model), lora_cfg(alpha=alpha), seed=0)
        opt = torch.optim.AdamW(lora.trainable_parameters(policy), lr=1e-2)
        c = cfg(grad_clip=grad_clip, micro_batch_size=4)
        b = batch_for(policy, N=10, seed=0)
        before = {k: p.detach().clone() for k, p in policy.named_parameters()}
        upd = learner.optimize(policy, None, opt, c, CPU, b)
        changed = [k for k, p in policy.named_parameters() if not torch.equal(p, before[k])]
        return upd, changed, opt

    for clip in (1.0, 0.0):
        upd, changed, opt = step(1e30, clip)
        assert upd.nonfinite == 1 and not math.isfinite(upd.grad_norm) and upd.per_update == []
        assert changed == [] and opt.state == {}  # no parameter and no optimizer-state change
        assert all(p.grad is None for p in opt.param_groups[0]["params"])  # the non-finite gradients are dropped
        upd, changed, opt = step(16.0, clip)  # negative control: a sane alpha steps
        assert upd.nonfinite == 0 and changed and len(opt.state) > 0 and len(upd.per_update) == 1
        assert math.isfinite(upd.stats["loss"])


def test_the_run_stops_at_max_nonfinite_steps_with_the_last_checkpoint_intact(tmp_path, char_model, capsys):
    cfg = cfg_for(tmp_path / "bad", steps=6, lora={"rank": 2, "alpha": 1e30}, grad_clip=0.0, max_nonfinite_steps=3)
    with pytest.raises(learner.NonFiniteError, match=r"step 3: 3 optimizer step\(s\).*--max-nonfinite-steps 3"):
        run(cfg, char_model)
    recs = [r for r in records(cfg.out) if "reward_mean" in r]
    assert [(r["step"], r["nonfinite_steps"]) for r in recs] == [(1, 1), (2, 1), (3, 1)]
    assert not math.isfinite(recs[0]["grad_norm"])
    saved = [d for _, d in ckpt.committed(Path(cfg.out) / "checkpoints")]
    assert [d.name for d in saved] == ["step_2"]  # written before the stop; the weights never moved
    assert ckpt.load_state(saved[0])["nonfinite_steps"] == 2
    # the CLI flag and its check (what main() runs first)
    assert parse(TrainConfig, ["--max-nonfinite-steps", "5"], CLI_PREFIXES).max_nonfinite_steps == 5
    with pytest.raises(SystemExit) as e:
        parse(TrainConfig, ["--max-nonfinite-steps", "0"], CLI_PREFIXES)
    assert e.value.code == 2 and "--max-nonfinite-steps must be >= 1, got 0" in capsys.readouterr().err
    # negative control: the same run with a sane alpha trains to the end, nothing skipped
    ok = cfg_for(tmp_path / "ok", steps=3, lora={"rank": 2, "alpha": 16.0}, grad_clip=0.0)
    run(ok, char_model)
    assert [r["nonfinite_steps"] for r in records(ok.out) if "reward_mean" in r] == [0, 0, 0]
    assert all(r["grad_norm"] > 0 for r in records(ok.out) if "reward_mean" in r)  # logged without clipping too


def test_a_model_holding_nan_is_never_checkpointed(tmp_path, char_model):
    out = tmp_path / "run"
    run(cfg_for(out, steps=2, keep_checkpoints=1), char_model)
    root = out / "checkpoints"
    policy = ckpt.load_model(root / "step_2", torch.float32)
    opt = torch.optim.AdamW(policy.parameters())
    state = ckpt.load_state(root / "step_2")
    extra = {k: state[k] for k in ("scheduler", "cursor")}
    with torch.no_grad():
        policy.model.norm.weight[0] = math.nan
    with pytest.raises(ckpt.CheckpointError, match=r"refusing to write checkpoint step_4.*model.norm.weight"):
        ckpt.save_any(root, 4, policy, opt, extra, keep=1)
    assert [d.name for _, d in ckpt.committed(root)] == ["step_2"]  # retention deleted nothing
    with torch.no_grad():
        policy.model.norm.weight[0] = 1.0
    ckpt.save_any(root, 4, policy, opt, extra, keep=1)  # negative control: finite weights are written
    assert [d.name for _, d in ckpt.committed(root)] == ["step_4"]


# ------------------------------------------------------------------------------------------------ rewards

REWARDS = """
def as_number(prompt, completion, **fields):
    return None if completion == "none" else float(completion)
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_rewards_float32_cannot_hold_are_errors(tmp_path, workers):
    f = tmp_path / "r.py"
    f.write_text(REWARDS)
    scorer = RewardScorer(load_rewards([f"{f}:as_number"]), workers=workers, timeout_s=30)
    try:
        texts = ["1e39", "inf", "-inf", "-1e39", "nan", "none", "3e38", "0.5"]
        s = scorer.score([({"prompt": "p"}, t) for t in texts])
    finally:
        scorer.close()
    assert len(s.errors) == 4 and s.failed == 4  # counted per call, like a raising reward
    assert all("float32 cannot hold" in e for e in s.errors) and "1e+39" in s.errors[0]
    assert all(math.isnan(t) for t in s.totals[:6])  # errors (4) and abstentions (2): unscorable
    assert s.totals[6:] == [3e38, 0.5]  # negative control: values float32 holds are rewards
    # a weighted sum beyond float32 is an error too; the same values with weight 1 are not
    scorer = RewardScorer(load_rewards([f"{f}:as_number", f"{f}:as_number"]), weights=[1.0, 1.0])
    s = scorer.score([({"prompt": "p"}, "3e38"), ({"prompt": "p"}, "1e38")])
    assert math.isnan(s.totals[0]) and s.totals[1] == 2e38 and s.failed == 1 and "weighted reward sum" in s.errors[0]
    assert 3e38 <= FLOAT32_MAX < 1e39


def test_a_1e39_reward_is_counted_not_a_crash(tmp_path, char_model):
    def huge(prompt: str, completion: str, **_) -> float:
        return 1e39 if completion.startswith("a") else completion.count("a") / 4

    cfg = cfg_for(tmp_path / "run", steps=2)
    run(cfg, char_model, reward=huge)
    recs = [r for r in records(cfg.out) if "reward_mean" in r]
    assert len(recs) == 2 and all(r["reward_mean"] <= 1 for r in recs)
    assert sum(r["reward_errors"] for r in recs) > 0  # some completions started with 'a' (0.4 of the vocabulary)


def test_a_step_with_nothing_scorable_warns(tmp_path, char_model, caplog):
    cfg = cfg_for(tmp_path / "run", steps=2)
    with caplog.at_level(logging.WARNING, logger="align.rollout.groups"):
        run(cfg, char_model, reward=lambda prompt, completion, **_: None)
    warned = [r.getMessage() for r in caplog.records if "no completion was scorable" in r.getMessage()]
    assert [w.split(":")[0] for w in warned] == ["step 1", "step 2"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="align.rollout.groups"):  # negative control: a reward that scores
        run(cfg_for(tmp_path / "ok", steps=1), char_model)
    assert not [r for r in caplog.records if "no completion was scorable" in r.getMessage()]
