"""``--lora-experts`` (align/lora.py on align/moe.py's experts): per-expert adapters against a hand-written loop
reference (outputs and each expert's adapter gradients), the grouped GEMM on adapted weights, the PEFT-named file
round trip, bad input."""

from __future__ import annotations

import json

import helpers_moe as tm
import pytest
import torch
import torch.nn.functional as F
from helpers_peft import peft_reference
from hf_reference import hf_model, save_hf

from align import lora, moe
from align.model import load_pretrained

X, K = 8, 3  # experts, top-k


def adapted_block(seed: int = 0, rank: int = 3) -> moe.SparseMoE:
    """A Qwen3-MoE sparse block (8 experts, top-3) with random base weights and non-zero adapters on its experts."""
    torch.manual_seed(seed)
    cfg = tm.moe_cfg("qwen3_moe", num_experts=X, num_experts_per_tok=K)
    block = moe.SparseMoE(cfg, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    for e in block.experts:
        for n in e.names:
            setattr(e, n, lora.LoRALinear(getattr(e, n), rank, 2.0, 0.0))
    with torch.no_grad():
        for n, p in block.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2)
    return block


def loop_reference(x, idx, w, block, swap=None):
    """sum_j w[n, j] * expert_e(x[n]) token by token from the raw tensors, W v + s * B (A v) per projection.
    ``swap`` (a, b): expert a computes with expert b's adapters (the negative control)."""

    def proj(e, src, name, v):
        m, a = getattr(block.experts[e], name), getattr(block.experts[src], name)
        return m.weight @ v + a.scaling * (a.lora_B.weight @ (a.lora_A.weight @ v))

    rows = []
    for n in range(x.shape[0]):
        acc = torch.zeros_like(x[n])
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            src = swap[1] if swap and e == swap[0] else e
            g, u, d = block.experts[e].names
            h = F.silu(proj(e, src, g, x[n])) * proj(e, src, u, x[n])
            acc = acc + w[n, j] * proj(e, src, d, h)
        rows.append(acc)
    return torch.stack(rows)


def adapter_grads(block, fn, x):
    block.zero_grad(set_to_none=True)
    fn(x).pow(2).sum().backward()
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in block.named_parameters()
        if "lora_" in n
    }


@pytest.mark.parametrize("grouped", [False, True] if moe.GROUPED_MM is not None else [False])
def test_expert_adapters_equal_a_loop_reference_per_expert(grouped):
    """The grouped expert compute with per-expert adapters == a token-by-token loop over the raw tensors: outputs
    and every expert's A / B gradient; experts no token used get none. Control: two experts' adapters swapped."""
    block = adapted_block()
    x = torch.randn(40, block.gate.in_features)
    with torch.no_grad():
        _, _, idx, w = block.route(x, None)
    idx[:, :] = torch.where(idx == X - 1, 0, idx)  # expert X-1 idle: its adapters must get no gradient
    idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % (X - 1), idx[:, 1])
    idx[:, 2] = torch.where((idx[:, 2] == idx[:, 0]) | (idx[:, 2] == idx[:, 1]), (idx[:, 1] + 1) % (X - 1), idx[:, 2])

    def ours(v):
        return moe.expert_mix(v, idx, w, block.experts, grouped=grouped)

    ref = loop_reference(x, idx, w, block)
    got = ours(x)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    base = [m.adapter_enabled for m in lora.lora_modules(block).values()]
    with lora.adapters_disabled(block):
        assert (ours(x) - ref).abs().max() > 1e-2  # the adapters change the output
    assert base == [m.adapter_enabled for m in lora.lora_modules(block).values()]
    g_ours = adapter_grads(block, ours, x)
    g_ref = adapter_grads(block, lambda v: loop_reference(v, idx, w, block), x)
    assert len(g_ours) == X * 3 * 2
    for n in g_ref:
        torch.testing.assert_close(g_ours[n], g_ref[n], atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
        idle = n.startswith(f"experts.{X - 1}.")
        assert (float(g_ours[n].abs().max()) == 0) == idle, n
    swapped = loop_reference(x, idx, w, block, swap=(1, 2))  # control: expert 1 with expert 2's adapters
    assert (swapped - got.detach()).abs().max() > 1e-3


def test_lora_experts_wraps_every_expert_and_round_trips(tmp_path):
    model = tm.tiny_moe()
    lora.apply_lora(model, lora.LoraConfig(rank=2, experts=True), base_model="tiny")
    wrapped = lora.lora_modules(model)
    experts = [n for n in wrapped if ".experts." in n]
    assert len(experts) == 2 * 6 * 3  # 2 MoE layers x 6 experts x (gate, up, down)
    assert "model.layers.1.mlp.up_proj" in wrapped and not [n for n in wrapped if n.endswith(".gate")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    ids = tm.ids_of(5, (2, 20)) % 96
    with torch.no_grad():
        torch.testing.assert_close(model(ids), tm.tiny_moe()(ids), atol=0, rtol=0)  # step 0: B = 0
        for n, p in model.named_parameters():
            if "lora_B" in n and ".experts." in n:  # only the experts' adapters move
                p.normal_(std=0.1)
    out = lora.save_adapter(model, tmp_path / "adapter")
    keys = lora.adapter_state_dict(model)
    assert "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight" in keys
    assert lora.read_adapter_config(out).experts  # found from the file's tensor names
    again = lora.load_adapter(tm.tiny_moe(), out, base_model="tiny")  # no flag needed: the file says so
    merged = lora.merged_model(model)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), atol=0, rtol=0)
        torch.testing.assert_close(merged(ids), model(ids), atol=1e-5, rtol=0)
        assert (tm.tiny_moe()(ids) - model(ids)).abs().max() > 1e-3  # control: the expert adapters matter
        with lora.adapters_disabled(model):
            torch.testing.assert_close(model(ids), tm.tiny_moe()(ids), atol=0, rtol=0)


def test_mixtral_expert_names_map_to_roles(tmp_path):
    model = tm.tiny_moe(model_type="mixtral", norm_topk_prob=True, mlp_only_layers=[])
    lora.apply_lora(model, lora.LoraConfig(rank=2, targets="q_proj,gate_proj", experts=True), base_model="m")
    names = sorted({n.rsplit(".", 1)[-1] for n in lora.lora_modules(model)})
    assert names == ["q_proj", "w1"]
    cfg = lora.read_adapter_config(lora.save_adapter(model, tmp_path / "a"))
    assert cfg.experts and cfg.target_names() == ["gate_proj", "q_proj"]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"rank": 0, "experts": True}, "--lora-experts given but --lora-rank is 0"),
        ({"rank": 2, "targets": "q_proj,v_proj", "experts": True}, "no expert projection is a target"),
    ],
)
def test_bad_lora_experts_is_named(kw, needle):
    with pytest.raises(ValueError, match=needle):
        lora.LoraConfig(**kw)


def test_lora_experts_on_a_dense_model_is_refused():
    model = tm.tiny_moe(model_type="qwen3", num_experts=0)
    with pytest.raises(ValueError, match="--lora-experts on a dense 'qwen3' model"):
        lora.apply_lora(model, lora.LoraConfig(rank=2, experts=True))


def test_peft_loads_an_align_expert_adapter_and_its_fused_layout_is_refused(tmp_path):
    """PEFT (on transformers' fused experts) reads align's per-expert adapter to the same logits; an adapter with
    PEFT's ``target_parameters`` (its fused-expert layout) is refused by name. Control: alpha x2 in the file."""

    base = save_hf(hf_model("qwen3_moe"), tmp_path / "base")
    model = lora.apply_lora(load_pretrained(base), lora.LoraConfig(rank=2, experts=True), base_model=base)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n and ".experts." in n:
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(2))
    ours = lora.save_adapter(model, tmp_path / "ours")
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for f in ours.iterdir():
        (scaled / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((ours / lora.ADAPTER_CONFIG).read_text())
    (scaled / lora.ADAPTER_CONFIG).write_text(json.dumps({**cfg, "lora_alpha": cfg["lora_alpha"] * 2}))
    ids = torch.arange(1, 21)[None]
    spec = {"base": base, "ids": ids.tolist(), "out": str(tmp_path / "o.safetensors"), "make": None}
    spec["load"] = {"ours": str(ours), "scaled": str(scaled)}
    ref = peft_reference(tmp_path, spec)
    with torch.no_grad():
        mine = model(ids)
        assert (mine - load_pretrained(base)(ids)).abs().max() > 1e-2  # the expert adapters matter
    assert (ref["ours"] - mine).abs().max() <= 1e-5
    assert (ref["scaled"] - mine).abs().max() > 1e-3  # control
    (scaled / lora.ADAPTER_CONFIG).write_text(json.dumps({**cfg, "target_parameters": ["gate_up_proj"]}))
    with pytest.raises(ValueError, match="target_parameters=.*fused expert tensors.*not read by align"):
        lora.read_adapter_config(scaled)
