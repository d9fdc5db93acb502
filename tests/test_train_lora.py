"""LoRA in the training loop: adapter-only checkpoints and optimizer, --save-hf / --merge-lora, exact resume
after kill -9, gradient checkpointing unchanged."""

from __future__ import annotations

import pytest
import torch
from test_train import PROMPTS, TOK, a_reward, cfg_for, cli_args, comparable, run_cli, wait_for_steps

from align import checkpoint as ckpt
from align import lora
from align.model import Transformer, load_pretrained, save_pretrained
from align.tasks import reverse
from align.train import train

MERGE_TOL = 1e-4  # merged export vs base + adapter (reassociated fp32 sums)
LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    cfg = reverse.model_config(TOK)
    cfg.num_hidden_layers = 1
    return str(save_pretrained(Transformer(cfg).init_weights(seed=0), tmp_path_factory.mktemp("tiny") / "m"))


def test_lora_run_checkpoints_adapter_and_exports(tmp_path, tiny_model):
    cfg = cfg_for(tmp_path / "a", lr=5e-2, save_hf=str(tmp_path / "adapter_out"), lora=LORA)
    train(cfg, model=tiny_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    step4 = tmp_path / "a" / "checkpoints" / "step_4"
    assert (step4 / "adapter" / "adapter_model.safetensors").is_file() and not (step4 / "model").exists()
    state = ckpt.load_state(step4)
    n_adapter = 2 * 7 * 1  # A and B on the 7 linears of the one layer
    assert len(state["optimizer"]["state"]) == n_adapter  # the optimizer owns only the adapters
    assert lora.adapter_base(tmp_path / "adapter_out") == tiny_model
    trained = lora.load_adapter(load_pretrained(tiny_model), tmp_path / "adapter_out")
    ids = torch.tensor([TOK.encode("abc=") + [0, 1]])
    with torch.no_grad():
        assert (trained(ids) - load_pretrained(tiny_model)(ids)).abs().max() > 1e-4  # it learned something
    # the same run with --merge-lora exports one merged HF checkpoint equal to base + adapter
    cfg = cfg_for(tmp_path / "b", lr=5e-2, save_hf=str(tmp_path / "merged_out"), merge_lora=True, lora=LORA)
    train(cfg, model=tiny_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    merged = load_pretrained(tmp_path / "merged_out")
    with torch.no_grad():
        assert (merged(ids) - trained(ids)).abs().max() <= MERGE_TOL


def test_gradient_checkpointing_unchanged_with_lora(tiny_model):
    ids = torch.tensor([TOK.encode("abcd=dcba"), TOK.encode("ddab=badd")])
    grads = []
    for gc in (False, True):
        model = lora.apply_lora(load_pretrained(tiny_model), lora.LoraConfig(**LORA), seed=0).train()
        with torch.no_grad():
            for m in lora.lora_modules(model).values():
                m.lora_B.weight.fill_(0.01)
        model.gradient_checkpointing = gc
        model(ids).log_softmax(-1)[..., 0].mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 14
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7)


LORA_ARGS = ["--lora-rank", "8", "--lora-alpha", "16", "--lr", "0.01"]


@pytest.mark.slow
def test_lora_kill_9_then_rerun_resumes_exactly(tmp_path, builtin_model):
    full = tmp_path / "full"
    proc = run_cli(cli_args(full, builtin_model) + LORA_ARGS)
    assert proc.wait(timeout=600) == 0, proc.stdout.read()[-3000:]
    out = tmp_path / "killed"
    proc = run_cli(cli_args(out, builtin_model) + LORA_ARGS)
    wait_for_steps(out, 5, proc)  # checkpoints at 2 and 4; step 5 or 6 may be mid-write
    proc.kill()
    proc.wait()
    rerun = run_cli(cli_args(out, builtin_model) + LORA_ARGS)
    log = rerun.communicate(timeout=600)[0]
    assert rerun.returncode == 0, log[-3000:]
    assert "resuming from" in log
    assert comparable(out) == comparable(full)
    # negative control: another LoRA init seed gives a different log, so the equality above is not vacuous
    other = tmp_path / "seed1"
    proc = run_cli(cli_args(other, builtin_model) + LORA_ARGS + ["--seed", "1", "--steps", "2"])
    assert proc.wait(timeout=600) == 0
    assert comparable(other)[1] != comparable(full)[1]
