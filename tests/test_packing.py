"""--pack-sequences (align.packing, align.attention): the loss and every parameter's gradient equal the padded path's.

The reference is today's padded path itself: ``learner.backward_batch`` with ``pack_sequences=False``, every
completion right-padded to its micro-batch's longest row and carrying its own copy of the prompt. Random-weight
models built here (Qwen2 with GQA and qkv bias, untied and tied; Llama without biases; Qwen3 with q/k norm; LoRA
adapters), groups of G completions with long prompts, ragged completions, a one-token completion and an invalid
one. Each comparison has a negative control that breaks one rule of the layout and must fail it.
"""

from __future__ import annotations

import pytest
import torch
from helpers_learner import CPU, cfg, siblings_visible

from align import learner, packing
from align.grpo import merge_stats
from align.lora import LoraConfig, apply_lora
from align.model import ModelConfig, Transformer
from align.rollout.protocol import Completion

PACK_TOL = {"rtol": 1e-5, "atol": 2e-6}  # fp32: the same sums in another order (per-segment attention, G copies summed)
FLEX_TOL = {"rtol": 1e-4, "atol": 2e-5}  # final hidden states (~1 in size): unfused FlexAttention math vs SDPA
BROKEN = 1e-4  # a broken layout moves some gradient entry by more than this (50x the tolerance)
V, P, G = 96, 4, 4  # vocabulary, prompts, completions per prompt

MODELS = {
    "qwen2_gqa_bias": {"model_type": "qwen2", "qkv_bias": True, "num_key_value_heads": 2},
    "qwen2_gqa_tied": {"model_type": "qwen2", "qkv_bias": True, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "llama_mha": {"model_type": "llama", "num_key_value_heads": 4},
    "qwen3_qk_norm": {"model_type": "qwen3", "qk_norm": True, "num_key_value_heads": 2},
    "lora": {"model_type": "qwen2", "qkv_bias": True, "num_key_value_heads": 2},
    "qwen3_moe_dense_interleaved": {
        "model_type": "qwen3_moe",
        "qk_norm": True,
        "num_key_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
}


def make_model(name: str, seed: int = 0) -> Transformer:
    fields = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "head_dim": 8, "max_position_embeddings": 128, **MODELS[name]}  # fmt: skip
    model = Transformer(ModelConfig(**fields)).init_weights(std=0.2, seed=seed)
    if name == "lora":
        apply_lora(model, LoraConfig(rank=4, alpha=8), seed=seed)
        with torch.no_grad():  # B = 0 at init would leave A without gradient
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return model


def make_batch(seed: int = 0, prompt_lens=(40, 3, 25, 1), max_new: int = 14) -> learner.Batch:
    """P prompts x G completions: long and short prompts, ragged completions, completion (0, 1) of one token,
    completion (2, 3) invalid (nothing to learn from)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in prompt_lens]
    comps = []
    for i in range(P * G):
        k = 1 if i == 1 else int(torch.randint(2, max_new + 1, (1,), generator=g))
        lp = (-torch.rand(k, generator=g) * 3).tolist()
        ids = torch.randint(0, V, (k,), generator=g).tolist()
        comps.append(Completion(prompt_index=i // G, sample_index=i % G, token_ids=ids, logprobs=lp,
                                sampled_logprobs=lp, finish_reason="length"))  # fmt: skip
    inputs, targets, mask, _, behav = learner.sequence_batch(prompts, comps, G, "cpu")
    mask[2 * G + 3] = False
    adv = torch.randn(P * G, generator=g)
    return learner.Batch(inputs, targets, mask, adv, behav)


def run(model, b, ref_model=None, **kw):
    """Loss, stats and every parameter's gradient of one backward_batch call."""
    model.zero_grad(set_to_none=True)
    st = merge_stats(learner.backward_batch(model, ref_model, cfg(**kw), *b, place=CPU))
    return st, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_same(got, want) -> None:
    (st_g, gr_g), (st_w, gr_w) = got, want
    assert st_g["loss"] == pytest.approx(st_w["loss"], rel=PACK_TOL["rtol"], abs=PACK_TOL["atol"])
    assert st_g["num_tokens"] == st_w["num_tokens"] and st_g["entropy"] == pytest.approx(st_w["entropy"], rel=1e-5)
    assert gr_g.keys() == gr_w.keys() and gr_g
    for k, v in gr_g.items():
        torch.testing.assert_close(v, gr_w[k], **PACK_TOL, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------------------------------------ the plan


def test_plan_shares_each_prompt_and_packs_within_the_budget():
    b = make_batch()
    lengths = learner.row_lengths(b.mask)
    rows = packing.plan(b.inputs, b.mask, lengths, budget=0, size=64)
    assert len(rows) == 1 and [p for p, _ in rows[0].groups] == [40, 3, 25, 1]  # one prompt copy per group
    assert sorted(rows[0].rows) == [i for i in range(P * G) if i != 2 * G + 3]
    budget = 60  # < the 40-token group's 40 + its completions: split over rows, one prompt copy in each
    rows = packing.plan(b.inputs, b.mask, lengths, budget=budget, size=64)
    assert all(r.tokens <= budget for r in rows) and sorted(i for r in rows for i in r.rows) == sorted(
        i for i in range(P * G) if lengths[i]
    )
    assert sum(p == 40 for r in rows for p, _ in r.groups) >= 2
    pk = packing.build(b.inputs, b.targets, b.mask, rows[0])
    assert pk.ids.shape[1] == rows[0].tokens == pk.layout.length
    seg = pk.layout.segments[0]
    pos = pk.positions[0]
    for c, n in seg.completions:  # completion positions continue from the prompt's length
        assert pos[c : c + n].tolist() == list(range(seg.prompt, seg.prompt + n))
    with pytest.raises(ValueError, match="--micro-batch-tokens 30 is smaller than one prompt and its longest"):
        packing.plan(b.inputs, b.mask, lengths, budget=30, size=64)


# ------------------------------------------------------------------------------------------------ equality


@pytest.mark.parametrize("name", MODELS)
def test_packed_loss_and_gradients_equal_the_padded_path(name):
    model, b = make_model(name), make_batch()
    padded = run(model, b, pack_sequences=False, entropy_coef=0.01)
    for kw in ({}, {"micro_batch_tokens": 60}, {"micro_batch_size": 3}):  # one row; a split group; 3-row chunks
        assert_same(run(model, b, pack_sequences=True, entropy_coef=0.01, **kw), padded)


@pytest.mark.parametrize("loss", ["seq_mean_token_mean", "gspo"])
def test_sequence_losses_and_kl_to_a_reference_equal_the_padded_path(loss):
    model, ref, b = make_model("qwen2_gqa_bias"), make_model("qwen2_gqa_bias", seed=1), make_batch(seed=2)
    padded = run(model, b, ref, pack_sequences=False, name=loss, kl_coef=0.1)
    assert padded[0]["kl"] > 0
    assert_same(run(model, b, ref, pack_sequences=True, name=loss, kl_coef=0.1, micro_batch_tokens=60), padded)


@pytest.mark.parametrize("name", ["qwen2_gqa_bias", "lora"])
def test_two_updates_with_kl_equal_the_padded_path(name):
    """--updates-per-batch 2 with a KL reference: the old and reference logprobs recomputed packed, then two SGD
    steps; a LoRA run's reference is the policy with its adapters off."""
    b = make_batch(seed=3)
    out = {}
    for pack in (False, True):
        model = make_model(name)
        ref = model if name == "lora" else make_model(name, seed=1)
        c = cfg(pack_sequences=pack, micro_batch_tokens=60, updates_per_batch=2, kl_coef=0.1, lr=0.5,
                eps_low=0.02, eps_high=0.02)  # fmt: skip
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=c.lr)
        upd = learner.optimize(model, ref, opt, c, CPU, b)
        out[pack] = upd, {k: p.detach().clone() for k, p in model.named_parameters()}
    (u0, p0), (u1, p1) = out[False], out[True]
    assert len(u1.per_update) == 2 and u1.per_update[1]["clip_low_frac"] + u1.per_update[1]["clip_high_frac"] > 0
    for a, w in zip(u1.per_update, u0.per_update):
        assert a["loss"] == pytest.approx(w["loss"], rel=1e-4, abs=1e-6) and a["kl"] == pytest.approx(w["kl"], rel=1e-4)
    for k in p0:
        torch.testing.assert_close(p1[k], p0[k], rtol=1e-4, atol=1e-5)
    assert max(float((p1[k] - make_model(name).state_dict()[k]).abs().max()) for k in p1) > 1e-3  # it moved


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_block_mask_equals_the_sdpa_layout():
    """The CUDA backend (FlexAttention block mask, the row padded to FLEX_BLOCK) on this CPU, forward only (torch has
    no CPU FlexAttention backward): the scored positions' hidden states equal the per-segment SDPA path's.
    Control: the SDPA path with siblings visible differs."""
    model, b = make_model("qwen2_gqa_bias"), make_batch()
    row = packing.plan(b.inputs, b.mask, learner.row_lengths(b.mask), budget=70, size=64)[0]
    sdpa = packing.build(b.inputs, b.targets, b.mask, row, backend="sdpa")
    flex = packing.build(b.inputs, b.targets, b.mask, row, backend="flex")
    assert flex.layout.length == packing.FLEX_BLOCK > sdpa.layout.length and torch.equal(flex.source, sdpa.source)

    def scored(pk, layout=None):
        with torch.no_grad():
            h = model(pk.ids, positions=pk.positions, layout=layout or pk.layout, return_hidden=True)  # (1, T, E)
        return h[0, pk.source]  # (M, E)

    want = scored(sdpa)
    torch.testing.assert_close(scored(flex), want, **FLEX_TOL)
    assert float((scored(sdpa, siblings_visible(sdpa.layout)) - want).abs().max()) > 100 * FLEX_TOL["atol"]


# ------------------------------------------------------------------------------------------------ negative controls


BREAKS = {
    "a completion sees its sibling": lambda pk: setattr(pk, "layout", siblings_visible(pk.layout)),
    "positions follow the packed offset": lambda pk: setattr(pk, "positions", torch.arange(pk.ids.shape[1])[None]),
}


@pytest.mark.parametrize("how", BREAKS)
def test_a_broken_layout_fails_the_comparison(how, monkeypatch):
    model, b = make_model("qwen2_gqa_bias"), make_batch()
    padded = run(model, b, pack_sequences=False)
    real = packing.build

    def broken(*a, **k):
        pk = real(*a, **k)
        BREAKS[how](pk)
        return pk

    monkeypatch.setattr(packing, "build", broken)
    assert max_diff(run(model, b, pack_sequences=True, micro_batch_tokens=60)[1], padded[1]) > BROKEN


def test_a_normaliser_counted_per_packed_row_fails_the_comparison():
    model, b = make_model("qwen2_gqa_bias"), make_batch()
    padded = run(model, b, pack_sequences=False)
    c = cfg(pack_sequences=True, micro_batch_tokens=60)
    rows = learner.plan_micro_batches(b.inputs, b.mask, c)
    assert len(rows) > 1
    model.zero_grad(set_to_none=True)
    for r in rows:  # each packed row as its own batch: normalised by its own tokens
        learner.backward_batch(model, None, c, *(t[r.rows] for t in b if t is not None), place=CPU)
    per_row = {k: p.grad.clone() for k, p in model.named_parameters()}
    assert max_diff(per_row, padded[1]) > BROKEN


# ------------------------------------------------------------------------------------------------ the sdpa plan


def visible_keys(layout) -> dict[int, list[int]]:
    """The plain loop reference: each row position's keys under the packed rule (a prompt token: its prompt's
    earlier tokens; a completion token: its prompt and its own earlier tokens), as row positions."""
    out = {}
    for s in layout.segments:
        prompt = list(range(s.start, s.start + s.prompt))
        for i in prompt:
            out[i] = prompt[: i - s.start + 1]
        for c, n in s.completions:
            for i in range(c, c + n):
                out[i] = prompt + list(range(c, i + 1))
    return out


def planned_keys(layout) -> dict[int, list[int]]:
    """What the sdpa plan computes: each real query's visible key slots (its call's mask, or causal), as row
    positions, read back from the calls and their gather indices."""
    cpu = torch.device("cpu")
    (calls, _), (qi, q_sizes, ki, k_sizes) = layout.sdpa_calls(cpu), layout.sdpa_gather(cpu)
    out = {}
    for (mask, unpad, n, Lq, Lk), q, k in zip(calls, qi.split(q_sizes), ki.split(k_sizes)):
        q, k = q.view(n, Lq), k.view(n, Lk)
        seen = torch.ones(Lq, Lk, dtype=torch.bool).tril()[None].expand(n, -1, -1) if mask is None else mask[:, 0]
        for flat in unpad.tolist():
            j, slot = divmod(flat, Lq)
            assert int(q[j, slot]) not in out, "a query computed twice"
            out[int(q[j, slot])] = k[j][seen[j, slot]].tolist()
    return out


def test_the_sdpa_plan_gives_each_token_its_keys_once_in_few_calls():
    """Every real query of the packed row sees exactly the plain loop's keys, each once (a visible pad slot would be
    a duplicate), over long and short prompts, one-token and single completions; the 8 groups of 4 ragged
    completions (uniform lengths up to 160: bucketing's worst case) in fewer calls than one per prompt and per group,
    each within the padding bound. Control: the plan
    of a layout whose first two siblings are merged gives another key set."""
    from align.attention import LENGTH_SLACK, PackedLayout, Segment

    g = torch.Generator().manual_seed(0)
    segs, at = [], 0
    for i, (p, sizes) in enumerate([(40, [9, 3, 14, 0]), (3, [12]), (25, [5, 5, 6, 1])] + [(5, [0] * 4)] * 8):
        seg = Segment(at, p)
        at += p
        for n in sizes if i < 3 else torch.randint(1, 160, (4,), generator=g).tolist():
            seg.completions.append((at, n))
            at += n
        segs.append(seg)
    layout = PackedLayout(segs, at)
    want = visible_keys(layout)
    assert planned_keys(layout) == want and len(want) == at
    calls, _ = layout.sdpa_calls(torch.device("cpu"))
    assert len(calls) <= 14 < 2 * 10  # the plan before: a call per prompt and per group of 2+ (here 14: 4 + 10)
    area = {i: s.prompt + n for s in segs for c, n in s.completions for i in range(c, c + n)}  # a query's n (P + n) / n
    q_index = layout.sdpa_gather(torch.device("cpu"))[0].split(layout.sdpa_gather(torch.device("cpu"))[1])
    for (mask, unpad, n, Lq, Lk), q in zip(calls, q_index):
        if mask is not None:  # padded query x key slots within LENGTH_SLACK^2 of its completions' n (P + n)
            assert n * Lq * Lk <= LENGTH_SLACK**2 * sum(area[int(i)] for i in q[unpad])
    assert planned_keys(siblings_visible(layout)) != want
