"""Mixture-of-experts compute on this CPU: align's grouped experts vs transformers' Qwen3-MoE on the same weights.

    .venv/bin/python benchmarks/bench_moe.py --threads 1            # needs transformers (the test venv has it)

(a) One forward + backward (cross-entropy over the full logits) of a Qwen3-MoE-shaped model, side by side in one
run on the same weights and batch: align (``align.moe.expert_mix``: tokens sorted by expert, torch's grouped GEMM in
``align.moe.GroupedExperts`` with its hand-written backward), transformers' ``Qwen3MoeForCausalLM`` (its default experts implementation: torch's ``grouped_mm``, and
``experts_implementation="eager"``: its loop over the hit experts), and align with the dense reference
``align.moe.dense_expert_mix`` (every token through every expert, weights zero where not routed) to show the grouped
path is the one running, and align with its fused CPU kernels off (``align.fused_cpu``: RMSNorm, RoPE, SwiGLU; the
torch composites ``ALIGN_FUSED_CPU=0`` runs). (b) Greedy decode tokens/s of the native sampler vs ``transformers.generate``. (c) A bf16
native sampler and an fp32 learner on the same weights: the sampler-trainer mismatch (|log pi - log mu|, rho) and
the routing mismatch of one GRPO batch, without and with ``--routing-replay rollout``.
Medians over interleaved repeats; ratios are what to read (absolute times on a shared CPU are noise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import best_time, numeric_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from align import fused_cpu, moe
from align.model import load_pretrained
from align.rollout.native import generate
from align.rollout.protocol import SamplingParams

SHAPE = {  # Qwen3-30B-A3B's proportions (128 experts, top-8, head_dim 128) scaled down to a CPU
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "max_position_embeddings": 1024,
}


def fwd_bwd(model, ids, hf: bool) -> None:
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits if hf else model(ids)  # (B, T, V)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    numeric_flags(p, threads=1, repeats=5, batch=4, tokens=256, decode_tokens=32)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hf_reference import hf_model

    hf = hf_model("qwen3_moe", std=0.05, **SHAPE).train()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_pretrained(d).train()
        import transformers

        eager = transformers.AutoModelForCausalLM.from_pretrained(d, experts_implementation="eager").float().train()
    ids = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((ours(ids) - hf(ids).logits).abs().max())
    grouped = moe.expert_mix
    runs = {
        "align": lambda: fwd_bwd(ours, ids, False),
        "transformers": lambda: fwd_bwd(hf, ids, True),
        "transformers_eager_loop": lambda: fwd_bwd(eager, ids, True),
        "align_dense_experts": lambda: fwd_bwd(ours, ids, False),
        "align_fused_cpu_off": lambda: fwd_bwd(ours, ids, False),  # the torch composites (ALIGN_FUSED_CPU=0)
    }
    usable = fused_cpu.usable
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}  # this process's CPU time: what other jobs do not inflate
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, fn in runs.items():
            moe.expert_mix = moe.dense_expert_mix if name == "align_dense_experts" else grouped
            fused_cpu.usable = (lambda *t: False) if name == "align_fused_cpu_off" else usable
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    moe.expert_mix, fused_cpu.usable = grouped, usable
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    low = {k: min(v[1:]) for k, v in cpu.items()}
    # each round's CPU time over the same round's transformers run: paired, so the machine's load cancels
    paired = {k: statistics.median(a / b for a, b in zip(v[1:], cpu["transformers"][1:])) for k, v in cpu.items()}
    shape = f"{args.batch} x {args.tokens} tokens, {SHAPE['num_experts']} experts top-{SHAPE['num_experts_per_tok']}"
    print(f"(a) forward+backward, {shape}, {args.threads} thread(s), median wall / least CPU time of {args.repeats}")
    print(f"    max |logit diff| {diff:.1e}; fused CPU kernels: {'on' if usable(ids.float()) else 'off'}")
    for k, v in med.items():
        r, rc = v / med["transformers"], low[k] / low["transformers"]
        print(
            f"  {k:<24} wall {v * 1e3:7.1f} ms {r:5.2f}x | CPU {low[k] * 1e3:7.1f} ms {rc:5.2f}x | "
            f"median paired CPU ratio {paired[k]:5.3f}x transformers"
        )
    floor(ours, hf, ids, args.repeats)
    components(ours, hf, args.batch, args.tokens, args.repeats)

    ours.eval(), hf.eval()
    prompts = ids[:, :16].tolist()
    n = args.decode_tokens
    params = SamplingParams(temperature=0, max_tokens=n)
    dec: dict[str, list[float]] = {"align": [], "transformers": []}
    for _ in range(3):
        t = time.perf_counter()
        generate(ours, prompts, params)
        dec["align"].append(time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids[:, :16], max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        dec["transformers"].append(time.perf_counter() - t)
    print(f"(b) greedy decode, {len(prompts)} prompts x {n} new tokens (median of 3)")
    for k, v in dec.items():
        tps = len(prompts) * n / statistics.median(v)
        print(f"  {k:<22} {tps:8.1f} tokens/s")
    replay_stats(ours, 4, args.decode_tokens)


SHARED_KERNELS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "grouped_mm",
    "_linear_pointwise",
    "flash_attention",
    "log_softmax",
)


def floor(ours, hf, ids, repeats: int) -> None:
    """The CPU time of the kernels both sides spend their time in (GEMMs, grouped GEMMs, flash attention, the loss's
    log-softmax; on an AMD CPU align's GEMMs are oneDNN's: ``align.cpu_linear``'s (``mkldnn._linear_pointwise``) and
    ``align.fused_cpu``'s ``gmm_rows`` / ``gmm_wgrad``, counted as GEMMs), timed per call inside each one's forward + backward, over the same round's whole transformers run:
    how far below transformers' time no change outside those kernels can take align."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Timed(TorchDispatchMode):
        shared = 0.0
        inside = False  # in one of align's GEMM ops: timed whole, not again per aten op inside it

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            c = time.process_time()
            out = func(*args, **(kwargs or {}))
            if not self.inside and any(k in str(func) for k in SHARED_KERNELS):
                self.shared += time.process_time() - c
            return out

    ops, load, timer = fused_cpu.load(), fused_cpu.load, {}

    class TimedOps:  # fused_cpu.load() for the timed runs: its GEMM ops timed as GEMMs
        def __getattr__(self, name):
            f = getattr(ops, name)
            if name not in ("gmm_rows", "gmm_wgrad") or "t" not in timer:
                return f

            def timed(*a):
                t, c = timer["t"], time.process_time()
                t.inside = True
                try:
                    return f(*a)
                finally:
                    t.inside = False
                    t.shared += time.process_time() - c

            return timed

    rows: dict[str, list[float]] = {"align": [], "transformers": [], "whole": []}
    fused_cpu.load = (lambda: TimedOps()) if ops is not None else load
    try:
        for _ in range(repeats):
            for name, model, is_hf in (("align", ours, False), ("transformers", hf, True)):
                with Timed() as t:
                    timer["t"] = t
                    fwd_bwd(model, ids, is_hf)
                rows[name].append(t.shared)
                timer.clear()
            c = time.process_time()
            fwd_bwd(hf, ids, True)
            rows["whole"].append(time.process_time() - c)
    finally:
        fused_cpu.load = load
    r = {k: statistics.median(a / b for a, b in zip(rows[k], rows["whole"])) for k in ("align", "transformers")}
    print(
        f"    GEMM + attention kernels alone (GEMMs, flash attention, log-softmax), median paired over transformers' "
        f"whole run: inside align {r['align']:.3f}x, inside transformers {r['transformers']:.3f}x"
    )


def cpu_ms(fn, repeats: int) -> float:
    """Least CPU time of ``fn()`` over ``repeats`` runs (after one warm-up), in ms."""
    return best_time(fn, repeats, time.process_time) * 1e3


def components(ours, hf, batch: int, tokens: int, repeats: int) -> None:
    """Where one forward + backward goes: layer 0's attention and MoE blocks in both implementations (CPU ms), and
    the kernels they share alone on the same shapes (flash attention; the grouped GEMMs at even expert loads)."""
    g = torch.Generator().manual_seed(2)
    E, X, Fd = SHAPE["hidden_size"], SHAPE["num_experts"], SHAPE["moe_intermediate_size"]
    x0 = torch.randn(batch, tokens, E, generator=g)
    pos = torch.arange(tokens).expand(batch, tokens)
    a_cos, a_sin = ours.rope(pos, x0.dtype)
    h_rope = hf.model.rotary_emb(x0, pos)
    la, lh = ours.model.layers[0], hf.model.layers[0]

    def fb(f):
        def run():
            x = x0.clone().requires_grad_(True)
            y = f(x)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(torch.ones_like(y))

        return run

    H, K, D = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    q, k, v = (torch.randn(batch, h, tokens, D, generator=g).requires_grad_(True) for h in (H, K, K))
    M = batch * tokens * SHAPE["num_experts_per_tok"]
    xs = torch.randn(M, E, generator=g).requires_grad_(True)
    w1, w2 = torch.randn(X, E, 2 * Fd, requires_grad=True), torch.randn(X, Fd, E, requires_grad=True)
    offs = torch.arange(1, X + 1, dtype=torch.int32) * (M // X)

    def gemms():
        gate, up = moe.GROUPED_MM(xs, w1, offs=offs).chunk(2, dim=-1)
        y = moe.GROUPED_MM(F.silu(gate) * up, w2, offs=offs)
        y.backward(torch.ones_like(y))

    def sdpa():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(torch.ones_like(o))

    attention = (lambda x: la.self_attn(x, a_cos, a_sin, 0, None, None), lambda x: lh.self_attn(x, h_rope, None))
    rows = {"attention block": attention, "MoE block": (lambda x: la.mlp(x, None), lambda x: lh.mlp(x))}
    print(f"    layer 0, forward + backward, least CPU ms of {repeats}:")
    for name, (fa, fh) in rows.items():
        a, h = cpu_ms(fb(fa), repeats), cpu_ms(fb(fh), repeats)
        print(f"  {name:<24} align {a:6.1f}  transformers {h:6.1f}  ({a / h:.2f}x)")
    x = x0.clone().requires_grad_(True)
    mib = {name: saved_mib(lambda f=f: f(x)) for name, f in zip(("align", "transformers"), rows["MoE block"])}
    print(f"  {'MoE block saved for bwd':<24} align {mib['align']:6.1f}  transformers {mib['transformers']:6.1f} MiB")
    if moe.GROUPED_MM is not None:
        print(
            f"  {'kernels alone':<24} flash attention {cpu_ms(sdpa, repeats):6.1f}  grouped GEMMs {cpu_ms(gemms, repeats):6.1f}"
        )


def saved_mib(fn) -> float:
    """MiB of the distinct storages autograd keeps for the backward of ``fn()`` (the stacked weights included)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values()) / 2**20


def replay_stats(model, n_prompts: int, max_tokens: int) -> None:
    from helpers_learner import CPU, cfg

    from align import learner
    from align.grpo import merge_stats

    sampler = load_pretrained_like(model, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SHAPE["vocab_size"], (16,), generator=g).tolist() for _ in range(n_prompts)]
    comps = generate(sampler, prompts, SamplingParams(n=4, temperature=1.0, max_tokens=max_tokens, seed=0))
    adv, valid = torch.randn(n_prompts, 4, generator=g), torch.ones(n_prompts, 4, dtype=torch.bool)
    c = cfg(group_size=4, max_tokens=max_tokens, prompts_per_step=n_prompts)
    b = learner.make_batch(learner.StepBatch(prompts, comps, adv, valid), c, torch.device("cpu"))
    print(f"(c) bf16 sampler, fp32 learner: {n_prompts} x 4 completions of {max_tokens} tokens")
    keys = ("moe/routing_mismatch", "moe/router_mismatch", "mismatch_abs_mean", "mismatch_abs_max", "rho_max",
            "clip_low_frac", "clip_high_frac")  # fmt: skip
    for mode in ("off", "rollout"):
        c.moe.routing_replay = mode
        model.zero_grad(set_to_none=True)
        st = merge_stats(learner.backward_batch(model, None, c, *b, place=CPU))
        print(f"  --routing-replay {mode:<8} " + "  ".join(f"{k} {st.get(k, float('nan')):.4f}" for k in keys))


def load_pretrained_like(model, dtype):
    from align.model import Transformer

    copy = Transformer(model.config).to(dtype)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


if __name__ == "__main__":
    main()
