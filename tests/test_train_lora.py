"""LoRA in the training loop: adapter-only checkpoints and optimizer, --save-hf / --merge-lora, exact resume
after kill -9, gradient checkpointing unchanged, the KL reference is the policy with its adapters off."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers_learner import CPU, batch_for
from helpers_learner import cfg as learner_cfg
from helpers_train import PROMPTS, TOK, a_reward, cfg_for, cli_args, comparable, records, run_cli, wait_for_steps

import align.model
from align import learner, lora
from align.model import load_pretrained
from align.run import checkpoint as ckpt
from align.train import main, train

MERGE_TOL = 1e-4  # merged export vs base + adapter (reassociated fp32 sums)
KL_TOL = 1e-6  # the same KL computed against two copies of the same base weights (fp32, same ops)
MOVED_MIN = 1e-3  # one update must move the adapted policy's logprobs at least this much off the base
LORA = {"rank": 4, "alpha": 8.0}


def test_lora_run_checkpoints_adapter_and_exports(tmp_path, char_model):
    cfg = cfg_for(tmp_path / "a", lr=5e-2, save_hf=str(tmp_path / "adapter_out"), lora=LORA)
    train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    step4 = tmp_path / "a" / "checkpoints" / "step_4"
    assert (step4 / "adapter" / "adapter_model.safetensors").is_file() and not (step4 / "model").exists()
    state = ckpt.load_state(step4)
    n_adapter = 2 * 7 * 1  # A and B on the 7 linears of the one layer
    assert len(state["optimizer"]["state"]) == n_adapter  # the optimizer owns only the adapters
    assert lora.adapter_base(tmp_path / "adapter_out") == char_model
    trained = lora.load_adapter(load_pretrained(char_model), tmp_path / "adapter_out")
    ids = torch.tensor([TOK.encode("abc=") + [0, 1]])
    with torch.no_grad():
        assert (trained(ids) - load_pretrained(char_model)(ids)).abs().max() > 1e-4  # it learned something
    # the same run with --merge-lora exports one merged HF checkpoint equal to base + adapter
    cfg = cfg_for(tmp_path / "b", lr=5e-2, save_hf=str(tmp_path / "merged_out"), merge_lora=True, lora=LORA)
    train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    merged = load_pretrained(tmp_path / "merged_out")
    with torch.no_grad():
        assert (merged(ids) - trained(ids)).abs().max() <= MERGE_TOL


def test_gradient_checkpointing_unchanged_with_lora(char_model):
    ids = torch.tensor([TOK.encode("abcd=dcba"), TOK.encode("ddab=badd")])
    grads = []
    for gc in (False, True):
        model = lora.apply_lora(load_pretrained(char_model), lora.LoraConfig(**LORA), seed=0).train()
        with torch.no_grad():
            for m in lora.lora_modules(model).values():
                m.lora_B.weight.fill_(0.01)
        model.gradient_checkpointing = gc
        model(ids).log_softmax(-1)[..., 0].mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 14
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7)


def test_lora_kl_reference_is_the_policy_with_adapters_off(char_model):
    base = load_pretrained(char_model).requires_grad_(False)
    policy = lora.apply_lora(load_pretrained(char_model), lora.LoraConfig(**LORA), seed=0)
    c = learner_cfg(kl_coef=0.1)
    batch = batch_for(policy)
    opt = torch.optim.Adam(lora.trainable_parameters(policy), lr=5e-2)
    learner.optimize(policy, policy, opt, c, CPU, batch)  # one update: B != 0, the policy left the base
    ref_base = learner.batch_logprobs(base, batch, c, CPU)
    assert torch.equal(learner.reference_logprobs(policy, batch, c, CPU), ref_base)
    with lora.adapters_disabled(policy):
        assert torch.equal(learner.batch_logprobs(policy, batch, c, CPU), ref_base)
    # negative control: with the adapters on (after the block too) the policy is not the base
    on = learner.batch_logprobs(policy, batch, c, CPU)
    assert (on - ref_base)[batch.mask].abs().max() > MOVED_MIN
    # the next KL update with the policy as its own reference equals the one with a separately loaded base
    twin = copy.deepcopy(policy)
    twin_opt = torch.optim.Adam(lora.trainable_parameters(twin), lr=5e-2)
    twin_opt.load_state_dict(opt.state_dict())
    own = learner.optimize(policy, policy, opt, c, CPU, batch).stats
    loaded = learner.optimize(twin, base, twin_opt, c, CPU, batch).stats
    assert own["kl"] > 10 * KL_TOL and abs(own["kl"] - loaded["kl"]) <= KL_TOL
    assert abs(own["loss"] - loaded["loss"]) <= KL_TOL


def test_lora_kl_run_loads_the_base_once(tmp_path, char_model, monkeypatch):
    loads = []
    real = align.model.load_pretrained
    monkeypatch.setattr(align.model, "load_pretrained", lambda *a, **kw: loads.append(a) or real(*a, **kw))
    cfg = cfg_for(tmp_path / "lora", steps=2, lr=5e-2, lora=LORA)
    cfg.loss.kl_coef = 0.1
    train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    assert len(loads) == 1, "LoRA + KL: the reference is the policy with its adapters off, not a second base"
    kl = [r["kl"] for r in records(tmp_path / "lora")]
    assert kl[0] == 0.0 and kl[1] > 0.0  # step 1: B = 0 (policy == base); step 2: measured against the base
    # control: the full fine-tune keeps its separately loaded (frozen) reference
    loads.clear()
    cfg = cfg_for(tmp_path / "full", steps=1)
    cfg.loss.kl_coef = 0.1
    train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    assert len(loads) == 2


LORA_ARGS = ["--lora-rank", "8", "--lora-alpha", "16", "--lr", "0.01"]


@pytest.mark.slow
def test_lora_kill_9_then_rerun_resumes_exactly(tmp_path, builtin_model, capsys):
    full = tmp_path / "full"
    assert main(cli_args(full, builtin_model) + LORA_ARGS) == 0  # in this process: only the killed run needs its own
    out = tmp_path / "killed"
    proc = run_cli(cli_args(out, builtin_model) + LORA_ARGS)
    wait_for_steps(out, 5, proc)  # checkpoints at 2 and 4; step 5 or 6 may be mid-write
    proc.kill()
    proc.wait()
    capsys.readouterr()
    assert main(cli_args(out, builtin_model) + LORA_ARGS) == 0  # the rerun, in this process
    assert "resuming from" in capsys.readouterr().out
    assert comparable(out) == comparable(full)
    # negative control: another LoRA init seed gives a different log, so the equality above is not vacuous
    other = tmp_path / "seed1"
    assert main(cli_args(other, builtin_model) + LORA_ARGS + ["--seed", "1", "--steps", "2"]) == 0
    assert comparable(other)[1] != comparable(full)[1]
