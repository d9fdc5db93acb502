"""Random-weight Hugging Face reference models built in the tests (transformers is test-only; no downloads)."""

from __future__ import annotations

import torch

# Architecture features each config exercises (the parity tests are parametrised over these).
FEATURES = {
    "qwen2_gqa_qkv_bias_untied": ("qwen2", {"tie_word_embeddings": False}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama_mha_untied": ("llama", {"num_key_value_heads": 4}),
    "llama3_rope_scaling_bias": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "rope_theta": 500000.0,
            "attention_bias": True,
            "mlp_bias": True,
            "rms_norm_eps": 1e-5,
        },
    ),
    "qwen3_qk_norm_head_dim_tied": ("qwen3", {"head_dim": 24, "tie_word_embeddings": True}),
}

# Mixture-of-experts configs (tests/test_moe.py): top-k, norm_topk_prob, dense layers interleaved, sliding window.
MOE_FEATURES = {
    "qwen3_moe_top2_norm": ("qwen3_moe", {"num_experts_per_tok": 2, "norm_topk_prob": True}),
    "qwen3_moe_top3_raw_dense_interleaved": (
        "qwen3_moe",
        {"num_hidden_layers": 3, "num_experts_per_tok": 3, "norm_topk_prob": False, "mlp_only_layers": [1]},
    ),
    "qwen3_moe_sparse_step2_tied": (
        "qwen3_moe",
        {"num_hidden_layers": 4, "decoder_sparse_step": 2, "tie_word_embeddings": True, "head_dim": 24},
    ),
    "mixtral_top2_window": ("mixtral", {"sliding_window": 24}),
}
MOE_DEFAULTS = {
    "qwen3_moe": {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 5, "num_experts_per_tok": 2, "intermediate_size": 48},
}


def hf_model(model_type: str, seed: int = 0, vocab_size: int = 97, std: float = 0.2, **overrides):
    """A random HF model in fp32 whose every parameter (norms and biases included) is random, so each
    architecture feature changes the logits."""
    import transformers

    classes = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }
    cfg_cls, model_cls = classes[model_type]
    kw = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rope_theta": 5000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    kw.update(MOE_DEFAULTS.get(model_type, {}))
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * std + (1.0 if "norm" in name else 0.0))
    return model


def save_hf(model, path) -> str:
    model.save_pretrained(str(path))
    return str(path)


def feature_pair(features: dict, name: str, tmp_path_factory) -> tuple:
    """(name, the transformers model of ``features[name]`` (model type, config overrides), its saved dir)."""
    model_type, overrides = features[name]
    hf = hf_model(model_type, **overrides)
    return name, hf, save_hf(hf, tmp_path_factory.mktemp(name))


def logits_vs_hf(path, hf, ids: torch.Tensor, atol: float) -> tuple:
    """align's model of the checkpoint at ``path`` gives ``hf``'s fp32 logits on ``ids`` within ``atol`` (and they are
    not near zero, so the comparison has teeth); returns (align's model, the reference logits) for a control."""
    from align.model import load_pretrained

    ours = load_pretrained(path)
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero tensors
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)
    return ours, ref


def assert_greedy_matches(ours, hf, prompts: list[list[int]], max_tokens: int = 12) -> list:
    """align's greedy sampler (cached decode) equals transformers.generate token for token; returns align's."""
    import torch

    from align.rollout.native import generate
    from align.rollout.protocol import SamplingParams

    outs = generate(ours, prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    for p, c in zip(prompts, outs):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert c.token_ids == ref[0, len(p) :].tolist()
    return outs
