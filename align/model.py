"""A pure-torch decoder for Llama / Qwen2 / Qwen3 and Qwen3-MoE / Mixtral (``align.moe``) that loads and saves HF
checkpoints.

Key decisions
- Parameter names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``), so loading is a
  strict key match with no permutation, and a saved directory loads unchanged in transformers and vLLM.
- The model is stateless. The KV cache is an explicit ``KVCache`` owned by the caller (the sampler),
  so cached and uncached runs are easy to compare. The attention call itself (RoPE, the cache, packed rows of
  shared-prefix segments) is in ``align.attention``.
- Numerics follow the HF reference: RMSNorm in fp32 then cast back, RoPE angles in fp32
  (``inv_freq * position``), rotate-half convention, attention scale ``1/sqrt(head_dim)``.

Shapes: B batch, T new tokens, S cached length, H query heads, K kv heads, D head dim, E hidden, V vocab.
References: Llama (Touvron et al. 2023), Llama-3 RoPE scaling, Qwen2/Qwen3 technical reports.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from align import fused_cpu, kernels
from align.atomic import COMMIT_MARKER, checkpoint_layout, commit_dir
from align.attention import KVCache, PackedLayout, apply_rope, attend, cache_mask, sliding_window
from align.errors import InputError, as_input_error
from align.moe import MOE_FAMILIES, Routing, SparseMoE, check_moe_config, is_sparse, moe_config, moe_hf_config

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",  # align.moe: MoE block, routing, replay
    "mixtral": "MixtralForCausalLM",
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", ...} or None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: True; Llama/Qwen3: config.attention_bias
    o_bias: bool = False  # Llama/Qwen3: config.attention_bias; Qwen2: False
    mlp_bias: bool = False  # Llama: config.mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    num_experts: int = 0  # MoE (align.moe): experts per MoE layer; 0 = dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    sliding_window: int | None = None  # Mixtral: attention to the last ``sliding_window`` keys
    hf_config: dict = field(default_factory=dict, repr=False)  # the original config.json, written back on save
    # the original generation_config.json (sampling defaults, stop ids, ...), written back on save
    generation_config: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if type(getattr(self, k)) is not int or getattr(self, k) <= 0:
                raise ValueError(f"config.json {k} is {getattr(self, k)!r}: it must be a positive integer")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; align supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ("llama3", "default"):
            raise ValueError(
                f"rope_scaling {self.rope_scaling!r} is not supported; align supports rope_type 'llama3' or none"
            )
        check_moe_config(self)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x ``rope_theta``/``rope_scaling``
        or 5.x ``rope_parameters``)."""
        mt = hf.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} is not supported; align supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported by align's model; set it to false")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; align supports 'silu'")
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or None
        if scaling:
            rope.update(scaling)
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=mt,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if mt == "qwen2" else attention_bias,
            o_bias=False if mt == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            hf_config=dict(hf),
            **moe_config(hf),
        )

    def to_hf_config(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The ``config.json`` dict: the original one when loaded from HF, else a fresh one."""
        hf = dict(self.hf_config)
        fresh = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.rope_scaling:
            fresh["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type != "qwen2":
            fresh["attention_bias"] = self.o_bias
        if self.model_type == "llama":
            fresh["mlp_bias"] = self.mlp_bias
        fresh |= moe_hf_config(self)
        for k, v in fresh.items():
            hf.setdefault(k, v)
        hf.setdefault("architectures", fresh["architectures"])
        if dtype is not None:
            hf["torch_dtype"] = str(dtype).removeprefix("torch.")
            hf.pop("dtype", None)
        return hf

    def num_params(self) -> int:
        E, F_, L, V = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        ffn = [
            self.num_experts * (3 * E * self.moe_intermediate_size + E) if is_sparse(self, i) else 3 * E * F_
            for i in range(L)
        ]
        return L * (E * (q + 2 * kv) + q * E + 2 * E) + sum(ffn) + V * E * (1 if self.tie_word_embeddings else 2) + E


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) in fp32, with Llama-3 scaling when configured."""
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type") == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:  # one fused kernel; the same math when nothing is cast
            return kernels.rms_norm(x, self.weight, self.eps)  # F.rms_norm's floats, a fused backward
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Linear):
    """``nn.Linear`` that can run on a prepacked copy of its weight (``align.rollout.native.packed_weights``)."""

    packed: Any = None  # a callable x -> x @ W.T + b, set only while sampling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x) if self.packed is not None else self.unpacked(x)

    def unpacked(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on its own weights (``align.lora.LoRALinear`` adds its low-rank path here)."""
        return fused_cpu.linear(x, self.weight, self.bias)  # F.linear; fp32 CPU: its backward by oneDNN


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, K, D, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.H, self.K, self.D = H, K, D
        self.q_proj = Linear(E, H * D, bias=cfg.qkv_bias)
        self.k_proj = Linear(E, K * D, bias=cfg.qkv_bias)
        self.v_proj = Linear(E, K * D, bias=cfg.qkv_bias)
        self.o_proj = Linear(H * D, E, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, layer: int, cache: KVCache | None, how: torch.Tensor | PackedLayout | None):
        if "decode" in self.__dict__ and (out := self.decode(x, cos, sin, layer, cache)) is not None:
            return out  # one new token per row, fused for CPU sampling (align.rollout.cpu_decode)
        B, T, _ = x.shape
        if "qkv" in self.__dict__:  # fused and packed for CPU sampling (native.packed_weights)
            q, k, v = self.qkv(x).split([self.H * self.D, self.K * self.D, self.K * self.D], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.H, self.D)
        k = k.view(B, T, self.K, self.D)
        v = v.view(B, T, self.K, self.D).transpose(1, 2)  # (B, K, T, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, K, T, D)
        if cache is not None:
            k, v = cache.write(layer, k, v)  # (B, K, S, D)
        out = attend(q, k, v, how)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.H * self.D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, F_ = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(E, F_, bias=cfg.mlp_bias)
        self.up_proj = Linear(E, F_, bias=cfg.mlp_bias)
        self.down_proj = Linear(F_, E, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "gate_up" in self.__dict__:  # fused and packed for CPU sampling (native.packed_weights)
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_index: int = -1):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.ffn = "mlp"  # the attribute of the feed-forward block: HF's name, the family's for a MoE block
        if moe_index >= 0:
            self.ffn = MOE_FAMILIES[cfg.model_type].block
            setattr(self, self.ffn, SparseMoE(cfg, moe_index))
        else:
            self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, layer, cache, how, routing: Routing | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, cache, how)
        ffn = getattr(self, self.ffn)
        h = self.post_attention_layernorm(x)
        return x + (ffn(h, routing) if isinstance(ffn, SparseMoE) else ffn(h))


class Transformer(nn.Module):
    """Decoder-only LM with HF parameter names. ``forward`` returns logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        sparse = [is_sparse(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.model.layers = nn.ModuleList(
            DecoderLayer(cfg, sum(sparse[:i]) if sparse[i] else -1) for i in range(cfg.num_hidden_layers)
        )
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.gradient_checkpointing = False

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> Transformer:
        """Random init (normal(0, std) for matrices, ones for norms, zeros for biases)."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin tables (B, 1, T, D) of ``positions`` (B, T) for ``apply_rope``."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # (B, T, D/2)
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layout: PackedLayout | None = None,
        return_hidden: bool = False,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T). Without a cache: causal attention over the row, positions 0..T-1 unless given
        (right padding is harmless: padded positions only follow the real tokens). With a cache: the T new
        tokens are written at ``cache.length`` and attend to every valid cached slot at or before them;
        the caller sets ``cache.valid`` for the new slots first and advances ``cache.length`` after. With a
        ``layout`` (``align.packing``): one packed row (B = 1) of shared-prefix segments, ``positions`` per segment.
        ``routing`` (MoE models, ``align.moe.Routing``): experts to replay per token, and the routes taken.
        Returns logits (B, T, V) in fp32 when the weights are fp32, or the final hidden states (B, T, E)
        when ``return_hidden``."""
        B, T = input_ids.shape
        x = self.model.embed_tokens(input_ids)  # (B, T, E)
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = self.rope(positions, x.dtype)
        how = cache_mask(cache, T) if cache is not None else layout  # (B, 1, T, S), a layout, or None = causal
        if self.config.sliding_window:
            how = sliding_window(how, T, self.config.sliding_window, x.device)
        for i, layer in enumerate(self.model.layers):
            if self.gradient_checkpointing and self.training and cache is None:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, i, None, how, routing, use_reentrant=False)
            else:
                x = layer(x, cos, sin, i, cache, how, routing)
        x = self.model.norm(x)
        return x if return_hidden else self.lm_head(x)


# ----------------------------------------------------------------------------------------------- checkpoints


def _read_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory: {cfg_path} is missing")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e}); re-export the checkpoint") from e


def _read_generation_config(path: Path) -> dict:
    gen_path = path / "generation_config.json"
    if not gen_path.is_file():
        return {}
    try:
        gen = json.loads(gen_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{gen_path} is not valid JSON ({e}); fix or delete it") from e
    if isinstance(gen, dict):
        return gen
    raise ValueError(f"{gen_path} must hold a JSON object, got {type(gen).__name__}; fix or delete it")


def generation_config(cfg: ModelConfig) -> dict:
    """The ``generation_config.json`` a save writes: the loaded checkpoint's own (its sampling defaults such as
    temperature / top_p, its stop-id list and any other key, unchanged), with the config's bos / eos / pad ids
    added where it has none and overriding it where they were changed after loading (differ from the original
    config.json). A model built from scratch writes only its ids."""
    gen = dict(cfg.generation_config)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(cfg, k)
        if v is not None and (k not in gen or v != cfg.hf_config.get(k)):
            gen[k] = v
    return gen


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"{path} has no model.safetensors or model.safetensors.index.json "
        "(align reads safetensors only; convert .bin checkpoints with transformers' save_pretrained)"
    )


def check_weight(t: torch.Tensor, name: str, path: Path, stored: torch.dtype) -> torch.Tensor:
    """``t`` (tensor ``name`` of file ``path``, ``stored`` as that dtype there) if it is a float tensor of finite
    values; else a ValueError naming both. An integer dtype in a weight file is a swapped header (an F32 -> I32 swap
    loads bit patterns as huge integers) or not a model; a NaN / inf weight makes every loss NaN."""
    if not stored.is_floating_point:
        raise ValueError(
            f"tensor {name!r} in {path} is stored as {stored}: model weights are floating point (F32/F16/BF16); "
            "the file's header was edited or it is not a model's weights"
        )
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(
            f"tensor {name!r} in {path} holds {bad} non-finite value(s) (NaN/inf) as {t.dtype}: training on it "
            "gives NaN losses; load an intact checkpoint (or a wider --precision if the values overflowed it)"
        )
    return t


def load_pretrained(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    require_marker: bool = False,
) -> Transformer:
    """Load an HF checkpoint directory strictly (every tensor present, no extra tensor, shapes equal).

    The model is built on the meta device and the loaded tensors are assigned, so the weights are
    allocated once. ``require_marker`` refuses a directory without the commit marker (snapshots
    written by ``save_pretrained``)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model path {path} does not exist or is not a directory")
    if require_marker and not (path / COMMIT_MARKER).exists():
        raise ValueError(f"{path} has no {COMMIT_MARKER} marker: it is an uncommitted (partial) snapshot")
    with as_input_error(f"{path}: "):  # a contradicting config.json (experts, heads ...) is bad input
        cfg = ModelConfig.from_hf_config(_read_config(path))
    cfg.generation_config = _read_generation_config(path)
    layers, embed = checkpoint_layout(_weight_files(path))  # before building: 10**6 meta layers take minutes
    if layers != cfg.num_hidden_layers or embed != [cfg.vocab_size, cfg.hidden_size]:
        raise InputError(
            f"{path / 'config.json'} says num_hidden_layers {cfg.num_hidden_layers}, vocab_size {cfg.vocab_size}, "
            f"hidden_size {cfg.hidden_size}; the weights hold {layers} layers, embed_tokens {embed}: fix config.json"
        )
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: v for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt", device=str(device)) as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                if name not in expected:
                    if cfg.tie_word_embeddings and name == "lm_head.weight":
                        continue  # some exporters write the tied head anyway; it is the embedding
                    raise InputError(f"unexpected tensor {name!r} in {f} (not part of a {cfg.model_type} model)")
                t = sf.get_tensor(name)
                if tuple(t.shape) != tuple(expected[name].shape):
                    raise InputError(
                        f"tensor {name!r} in {f} has shape {tuple(t.shape)}, the config expects "
                        f"{tuple(expected[name].shape)}: the checkpoint does not match its config.json"
                    )
                state[name] = check_weight(t.to(dtype), name, f, t.dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise InputError(
            f"checkpoint {path} is missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = 2 * 1024**3,
    copy_tokenizer_from: str | os.PathLike | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write an HF directory atomically: into a temporary sibling, commit marker last, then rename.

    Writes config.json, model.safetensors (or shards + model.safetensors.index.json beyond
    ``max_shard_bytes``), generation_config.json (the loaded checkpoint's, see ``generation_config``), tokenizer
    files from ``copy_tokenizer_from`` when given, then ``.complete``. An existing directory at ``path`` is replaced."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        cfg = model.config
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        dtype = next(iter(state.values())).dtype
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_config(dtype), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(cfg), indent=2))
        if copy_tokenizer_from is not None:
            for f in Path(copy_tokenizer_from).iterdir():
                if f.is_file() and (
                    f.name.startswith("tokenizer")
                    or f.name
                    in (
                        "vocab.json",
                        "merges.txt",
                        "special_tokens_map.json",
                        "chat_template.jinja",
                        "added_tokens.json",
                        "align_tokenizer.json",
                    )
                ):
                    shutil.copy2(f, tmp / f.name)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        commit_dir(tmp, path, {"format": "align-hf", "dtype": str(dtype)})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def config_dict(cfg: ModelConfig) -> dict:
    """A JSON-safe dict of the align-side config (for logs)."""
    d = asdict(cfg)
    d.pop("hf_config", None)
    d.pop("generation_config", None)
    return d
