"""Tiny mixture-of-experts models and inputs shared by the MoE tests (test_moe, test_moe_lora, test_routes_wire)."""

from __future__ import annotations

import torch
from hf_reference import hf_model

from align import moe
from align.model import ModelConfig, Transformer


def ids_of(seed: int, shape=(3, 40)) -> torch.Tensor:
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed))


def sparse_blocks(model: Transformer) -> list[moe.SparseMoE]:
    return [m for m in model.modules() if isinstance(m, moe.SparseMoE)]


def moe_cfg(model_type: str, **kw) -> ModelConfig:
    hf = hf_model(model_type, **kw).config.to_dict()
    return ModelConfig.from_hf_config(hf)


def tiny_moe(seed: int = 0, **kw) -> Transformer:
    fields = {
        "model_type": "qwen3_moe",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 128,
        "qk_norm": True,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        **kw,
    }
    return Transformer(ModelConfig(**fields)).init_weights(std=0.2, seed=seed)
