"""align.model vs transformers on random-weight checkpoints built here (no downloads)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_reference import FEATURES, assert_greedy_matches, feature_pair, hf_model, logits_vs_hf, save_hf

from align.atomic import COMMIT_MARKER
from align.model import ModelConfig, Transformer, load_pretrained, save_pretrained
from align.rollout.native import generate
from align.rollout.protocol import SamplingParams

LOGIT_ATOL = 1e-5  # fp32 logits, |logit| ~ 5
BF16_RTOL = 0.05  # bf16 vs fp32 logits, relative to the logit scale


@pytest.fixture(scope="module", params=sorted(FEATURES))
def pair(request, tmp_path_factory):
    return feature_pair(FEATURES, request.param, tmp_path_factory)


def test_fp32_logits_match_transformers(pair):
    _name, hf, path = pair
    ids = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    ours, ref = logits_vs_hf(path, hf, ids, LOGIT_ATOL)
    # Negative control: one weight perturbed by 1e-2 must break the match.
    with torch.no_grad():
        ours.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-2
        bad = ours(ids)
    assert (bad - ref).abs().max() > LOGIT_ATOL


def test_architecture_feature_matters_negative_control(pair):
    """Each config's distinguishing feature changes the logits: dropping it breaks parity."""
    name, hf, path = pair
    ours = load_pretrained(path)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        if "rope_scaling" in name:
            cfg = ours.config
            ours.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        elif "qk_norm" in name:
            ours.model.layers[0].self_attn.qk_norm = False
        elif "qkv_bias" in name:
            ours.model.layers[0].self_attn.q_proj.bias.zero_()
        elif "tied" in name:
            ours.lm_head.weight = torch.nn.Parameter(ours.lm_head.weight.clone() * 1.01)
        else:  # GQA / MHA: shuffle the kv heads
            k = ours.model.layers[0].self_attn.k_proj.weight
            k.copy_(k.roll(16, dims=0))
        got = ours(ids)
    assert (got - ref).abs().max() > 1e-3


def test_greedy_generation_matches_transformers(pair):
    _name, hf, path = pair
    ours = load_pretrained(path)
    prompts = [[1, 5, 9, 13], [7, 3], [11, 12, 13, 14, 15, 16, 17]]
    assert_greedy_matches(ours, hf, prompts)


def test_bf16_loads_and_runs(pair):
    _name, hf, path = pair
    ours = load_pretrained(path, dtype=torch.bfloat16)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).float()
    scale = ref.abs().max()
    assert (got - ref).abs().max() < BF16_RTOL * scale * 4
    assert (got - ref).abs().max() > 0  # really bf16, not silently fp32
    out = generate(ours, [[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=5, seed=0))
    assert len(out[0].token_ids) == 5


def test_unsupported_model_type_is_rejected():
    with pytest.raises(ValueError, match="llama, qwen2, qwen3"):
        ModelConfig.from_hf_config({"model_type": "gpt2", "vocab_size": 10})


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_hf(hf_model("qwen2"), tmp_path / "m")
    weights = load_file(os.path.join(path, "model.safetensors"))

    def rewrite(sd):
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    sd = dict(weights)
    sd.pop("model.layers.1.mlp.down_proj.weight")
    rewrite(sd)
    with pytest.raises(ValueError, match="missing tensors: model.layers.1.mlp.down_proj.weight"):
        load_pretrained(path)
    rewrite({**weights, "model.layers.0.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.extra.weight'"):
        load_pretrained(path)
    rewrite({**weights, "model.norm.weight": torch.zeros(65)})
    with pytest.raises(ValueError, match="'model.norm.weight'.*shape"):
        load_pretrained(path)
    rewrite(weights)
    load_pretrained(path)  # control: the untouched weights load


def test_bad_paths_are_clear(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json is missing"):
        load_pretrained(tmp_path / "empty")


@pytest.mark.parametrize("shard_bytes", [2 * 1024**3, 20_000])
def test_save_roundtrip_loads_in_transformers(tmp_path, shard_bytes):
    import transformers

    hf = hf_model("qwen3", head_dim=24, tie_word_embeddings=True)
    ours = load_pretrained(save_hf(hf, tmp_path / "src"))
    out = save_pretrained(ours, tmp_path / "snap", max_shard_bytes=shard_bytes)
    files = sorted(os.listdir(out))
    assert COMMIT_MARKER in files and "generation_config.json" in files
    assert ("model.safetensors.index.json" in files) == (shard_bytes < 1e6)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    again = load_pretrained(out, require_marker=True)
    ids = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(again(ids), ours(ids), atol=0, rtol=0)


def test_save_failure_leaves_nothing_and_marker_gate(tmp_path, monkeypatch):
    import safetensors.torch

    ours = load_pretrained(save_hf(hf_model("llama"), tmp_path / "src"))

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="No space"):
        save_pretrained(ours, tmp_path / "snap")
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no half-written directory, no temp left
    monkeypatch.undo()
    save_pretrained(ours, tmp_path / "snap")
    os.remove(tmp_path / "snap" / COMMIT_MARKER)
    with pytest.raises(ValueError, match="uncommitted"):
        load_pretrained(tmp_path / "snap", require_marker=True)


# a one-layer Qwen2 built in the test (no checkpoint): the config and generation-config round trips
TINY = {"model_type": "qwen2", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
TINY.update(num_attention_heads=2, num_key_value_heads=1, head_dim=16, qkv_bias=True)


def test_fresh_model_config_roundtrip(tmp_path):
    cfg = ModelConfig(**TINY, eos_token_id=2)
    m = Transformer(cfg).init_weights(seed=0)
    path = save_pretrained(m, tmp_path / "m")
    hf_cfg = json.loads((path / "config.json").read_text())
    assert hf_cfg["model_type"] == "qwen2" and hf_cfg["architectures"] == ["Qwen2ForCausalLM"]
    back = load_pretrained(path)
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), m(ids), atol=0, rtol=0)


def test_save_keeps_the_base_generation_config(tmp_path):
    from align import lora

    cfg = ModelConfig(**TINY, bos_token_id=1, eos_token_id=2)
    base = save_pretrained(Transformer(cfg).init_weights(seed=0), tmp_path / "base")
    # negative control: a model built from scratch writes only its token ids
    assert json.loads((base / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    gen = {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
           "top_k": 20, "repetition_penalty": 1.05, "custom_key": {"x": [1, 2]}, "transformers_version": "4.51.0"}  # fmt: skip
    (base / "generation_config.json").write_text(json.dumps(gen))
    model = load_pretrained(base)
    for out in (save_pretrained(model, tmp_path / "snap"), save_pretrained(load_pretrained(tmp_path / "snap"),
                tmp_path / "again")):  # fmt: skip
        assert json.loads((out / "generation_config.json").read_text()) == gen  # the stop-id list [2, 7] kept too
    # a LoRA policy merged for export (--save-hf --merge-lora, eval / rollout snapshots) keeps it as well
    policy = lora.apply_lora(load_pretrained(base), lora.LoraConfig(rank=2), base_model=base)
    merged = lora.save_policy(policy, tmp_path / "merged", merge=True)
    assert json.loads((merged / "generation_config.json").read_text()) == gen
    # an id changed after loading is ours: it overrides the base's; everything else stays
    model.config.eos_token_id, model.config.pad_token_id = 9, 0
    out = json.loads((save_pretrained(model, tmp_path / "changed") / "generation_config.json").read_text())
    assert out == {**gen, "eos_token_id": 9, "pad_token_id": 0}
