"""LoRA (align/lora.py): the wrapper, the PEFT file format, parity with peft on transformers, the sampler.

peft and transformers are test-only: the peft side runs in a subprocess of a venv that has both
(``.venv`` if it has peft, else ``.venv-rollout``); without peft anywhere the parity test fails.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers_models import make_tiny_qwen2
from helpers_peft import peft_reference

from align import lora
from align.model import load_pretrained, save_pretrained
from align.rollout.native import generate
from align.rollout.protocol import SamplingParams

REPO = Path(__file__).resolve().parents[1]
PEFT_TOL = 1e-5  # max |logit diff| align vs peft on transformers, fp32
MERGE_TOL = 1e-4  # low-rank path vs merged weights (W x + s B A x vs (W + s B A) x: reassociated fp32 sums)
NEGATIVE_MIN = 1e-3  # a doubled alpha must move the logits at least this much


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("lora") / "base", seed=0)


def lora_model(base_dir: Path, rank: int = 4, targets: str = lora.ALL_LINEAR, alpha: float | None = 8.0, seed: int = 0):
    model = load_pretrained(base_dir)
    lora.apply_lora(model, lora.LoraConfig(rank=rank, alpha=alpha, targets=targets), base_model=base_dir, seed=seed)
    return model


def randomise_b(model, seed: int = 3, std: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * std)


IDS = torch.tensor([[1, 17, 99, 123, 7, 300, 45, 2], [5, 6, 7, 8, 9, 10, 11, 12]])


# ------------------------------------------------------------------------------------------ wrapper


def test_step0_equals_base_and_only_adapters_train(base_dir):
    base = load_pretrained(base_dir)
    model = lora_model(base_dir)
    with torch.no_grad():
        assert torch.equal(model(IDS), base(IDS)), "B = 0: the wrapped model must equal the base at step 0"
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    per_layer = {n.split(".")[-3] for n in names}
    assert per_layer == set(lora.DECODER_LINEARS)  # default: every decoder linear, no embedding, no lm_head
    assert len(names) == 2 * 7 * model.config.num_hidden_layers
    assert len(lora.trainable_parameters(model)) == len(names)
    # HF names of the base are kept: a plain state dict key match.
    assert set(base.state_dict()) <= set(model.state_dict())
    a = model.model.layers[0].self_attn.q_proj.lora_A.weight
    assert a.abs().sum() > 0 and model.model.layers[0].self_attn.q_proj.lora_B.weight.abs().sum() == 0
    # one optimizer step moves only the adapters; the frozen weights stay bit-identical
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-2)
    model.train()
    model(IDS).logsumexp(-1).mean().backward()
    opt.step()
    for n, p in model.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(p, before[n]), f"frozen {n} moved"
        elif ".lora_B." in n:
            assert not torch.equal(p, before[n]), f"{n} did not train"
    with torch.no_grad():
        assert (model(IDS) - base(IDS)).abs().max() > 1e-4, "after a step the adapter must change the logits"


def test_targets_subset_and_seeded_init(base_dir):
    m1 = lora_model(base_dir, targets="q_proj,v_proj", seed=5)
    m2 = lora_model(base_dir, targets="q_proj,v_proj", seed=5)
    assert {n.rsplit(".", 1)[-1] for n in lora.lora_modules(m1)} == {"q_proj", "v_proj"}
    for (n, a), (_, b) in zip(lora.adapter_state_dict(m1).items(), lora.adapter_state_dict(m2).items()):
        assert torch.equal(a, b), n


def test_lora_forward_equals_merged_copy(base_dir):
    model = lora_model(base_dir)
    randomise_b(model)
    merged = lora.merged_model(model)
    assert not any(".lora_" in k for k in merged.state_dict())
    with torch.no_grad():
        got, want = model(IDS), merged(IDS)
        assert (got - want).abs().max() <= MERGE_TOL
        base = load_pretrained(base_dir)(IDS)
        assert (got - base).abs().max() > NEGATIVE_MIN  # negative control: the adapter matters


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"rank": 4, "targets": "q_proj,foo_proj"}, "foo_proj matches no linear"),
        ({"rank": 4, "targets": "lm_head"}, "lm_head matches no linear"),
        ({"rank": 0, "alpha": 16.0}, "--lora-alpha 16.0 given but --lora-rank is 0"),
        ({"rank": 0, "targets": "q_proj"}, "--lora-rank is 0"),
        ({"rank": -1}, "--lora-rank must be >= 0"),
        ({"rank": 4, "dropout": 1.0}, "--lora-dropout"),
        ({"rank": 4, "alpha": 0.0}, "--lora-alpha must be > 0"),
    ],
)
def test_bad_config_is_a_clear_error(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        lora.LoraConfig(**kw)


def test_merge_lora_without_lora_is_an_error():
    from align.train import TrainConfig

    with pytest.raises(ValueError, match="--merge-lora needs --lora-rank"):
        TrainConfig(merge_lora=True, save_hf="x")
    with pytest.raises(ValueError, match="--lora-alpha 8.0 given but --lora-rank is 0"):
        TrainConfig(lora={"alpha": 8.0})
    assert TrainConfig(lora={"rank": 8}).lora.scaling == 1.0


# ------------------------------------------------------------------------------------------ files


def test_save_writes_peft_names_and_roundtrips(base_dir, tmp_path):
    from safetensors import safe_open

    model = lora_model(base_dir, targets="q_proj,down_proj")
    randomise_b(model)
    out = lora.save_adapter(model, tmp_path / "adapter")
    assert (out / ".complete").is_file() and not list(tmp_path.glob(".adapter.tmp-*"))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["peft_type"] == "LORA"
    assert cfg["target_modules"] == ["down_proj", "q_proj"] and cfg["base_model_name_or_path"] == str(base_dir)
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 2 * 2 * 2
    fresh = lora.load_adapter(load_pretrained(base_dir), out)
    with torch.no_grad():
        assert torch.equal(fresh(IDS), model(IDS))
    # into an already-wrapped model too (checkpoint resume)
    again = lora.load_adapter(lora_model(base_dir, targets="q_proj,down_proj", seed=9), out)
    with torch.no_grad():
        assert torch.equal(again(IDS), model(IDS))


def test_adapter_for_another_base_is_a_clear_error(base_dir, tmp_path):
    model = lora_model(base_dir)
    adapter = lora.save_adapter(model, tmp_path / "adapter")
    other = make_tiny_qwen2(tmp_path / "other", seed=1, hidden_size=64, intermediate_size=96)
    with pytest.raises(ValueError, match="has shape .* the adapter was trained on a different base model"):
        lora.load_adapter(load_pretrained(other), adapter, base_model=str(base_dir))
    with pytest.raises(ValueError, match="was trained on base model .* but the loaded model is"):
        lora.load_adapter(load_pretrained(other), adapter, base_model=str(other))
    deeper = make_tiny_qwen2(tmp_path / "deeper", seed=1, num_hidden_layers=3)
    with pytest.raises(ValueError, match="lacks tensors"):
        lora.load_adapter(load_pretrained(deeper), adapter, base_model=str(base_dir))
    with pytest.raises(ValueError, match="rank 4 .* the model's adapters have rank 2"):
        lora.load_adapter(lora_model(base_dir, rank=2), adapter)
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        lora.load_adapter(load_pretrained(base_dir), base_dir)
    dora = tmp_path / "dora"
    shutil.copytree(adapter, dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        lora.load_adapter(load_pretrained(base_dir), dora)


# ------------------------------------------------------------------------------------------ peft parity


def with_alpha(src: Path, dst: Path, factor: float) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": cfg["lora_alpha"] * factor}))
    return dst


def test_parity_with_peft_both_ways(base_dir, tmp_path):

    model = lora_model(base_dir, rank=4, alpha=8.0)
    randomise_b(model)
    ours = lora.save_adapter(model, tmp_path / "ours")
    scaled = with_alpha(ours, tmp_path / "ours_scaled", 2.0)
    spec = {
        "base": str(base_dir),
        "ids": IDS.tolist(),
        "out": str(tmp_path / "peft_logits.safetensors"),
        "load": {"ours": str(ours), "ours_scaled": str(scaled)},
        "make": str(tmp_path / "theirs"),
    }
    ref = peft_reference(tmp_path, spec)
    with torch.no_grad():
        # align-written adapter in peft
        mine = model(IDS)
        assert (ref["ours"] - mine).abs().max() <= PEFT_TOL
        assert (ref["ours_scaled"] - mine).abs().max() > NEGATIVE_MIN  # negative control: alpha x2 is caught
        # peft-written adapter in align
        theirs = lora.load_adapter(load_pretrained(base_dir), tmp_path / "theirs", base_model=str(base_dir))
        assert {n.rsplit(".", 1)[-1] for n in lora.lora_modules(theirs)} == {"q_proj", "v_proj", "down_proj"}
        assert (theirs(IDS) - ref["made"]).abs().max() <= PEFT_TOL
        wrong = lora.load_adapter(load_pretrained(base_dir), with_alpha(tmp_path / "theirs", tmp_path / "t2", 2.0))
        assert (wrong(IDS) - ref["made"]).abs().max() > NEGATIVE_MIN  # negative control


# ------------------------------------------------------------------------------------------ sampler


@pytest.mark.parametrize("pack", [True, False])
def test_sampler_uses_adapter_without_merging(base_dir, pack):
    model = lora_model(base_dir)
    randomise_b(model, std=0.2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = [[1, 17, 99], [5, 6, 7, 8, 9]]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7)
    got = generate(model, prompts, params, pack_weights=pack)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "generation must not change any weight"
    want = generate(lora.merged_model(model), prompts, params, pack_weights=pack)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    diff = max(abs(a - b) for c, d in zip(got, want) for a, b in zip(c.logprobs, d.logprobs))
    assert diff <= MERGE_TOL
    base = generate(load_pretrained(base_dir), prompts, params, pack_weights=pack)  # negative control
    assert [c.token_ids for c in base] != [c.token_ids for c in got]


def test_merged_export_loads_as_plain_checkpoint(base_dir, tmp_path):
    model = lora_model(base_dir)
    randomise_b(model)
    save_pretrained(lora.merged_model(model), tmp_path / "merged")
    with torch.no_grad():
        assert (load_pretrained(tmp_path / "merged")(IDS) - model(IDS)).abs().max() <= MERGE_TOL
