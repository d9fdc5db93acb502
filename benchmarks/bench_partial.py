"""Partial rollouts (--partial-rollouts): steps/s, the generator's idle fraction and held-out pass@1 with and
without them, side by side in one run, on completions with a long-tailed length distribution; and the token-lag
histogram of the partial run.

    .venv/bin/python benchmarks/bench_partial.py [--steps 12] [--prompts 8] [--group-size 4]

The length sampler: a policy whose next-token distribution is a Markov chain on the last token (decoder layers
whose output projections start at zero, so the residual stream is the one-hot embedding, which the final norm
carries into an lm_head holding the log transition matrix), so the lengths follow a chosen shape, decoding costs
what ``--layers`` x ``--hidden`` cost, and training still moves it. The default shape (1 x 16) keeps a decode
step's cost nearly flat in the number of rows (per-step overhead), the regime of a GPU's memory-bound decode that
partial rollouts are for: the call's length in steps is what they shorten, while the pool holds 2x the rows. A
compute-bound CPU shape (``--layers 4 --hidden 64``) pays per row, so the extra rows eat most of the gain. After the prompt's ``=`` a row enters a "short" mode
(tokens a-d, <eos> hazard 3% per token) with probability 0.7 or a "long" mode (w-z, hazard 0.8%): median ~32,
p90 ~140, ~8% at the 160-token cap (seed 003's Goedel-Prover-V2-8B shape, 3.2k : 14k : 16k, scaled down 100x).
The reward: 1 when the completion's last token before <eos> is ``c`` (pass@1 ~ 0.2 at the start). Native sampler,
--max-async-steps 1, one torch thread; each run trains a fresh copy of the same model with the same prompts and
seeds; only --partial-rollouts differs (a short warm-up run first; then --repeats runs of each, interleaved in
alternating order; the median of each figure). Printed: steps/s over the steps after the first, the generator's idle
fraction (its wait for the trainer / the loop time), the producer's generate + score seconds per step
(``rollout_time``), held-out pass@1 after the last step, the ratios, and the histogram of the partial runs' token
lags.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from common import numeric_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from align.char_tokenizer import CharTokenizer
from align.model import ModelConfig, Transformer, save_pretrained
from align.rollout import partial
from align.rollout.native import generate
from align.rollout.protocol import SamplingParams
from align.train import TrainConfig, train

TOK = CharTokenizer("=abcdwxyz")
CAP = 160
SHORT, LONG = "abcd", "wxyz"
P_SHORT, HAZARD_SHORT, HAZARD_LONG = 0.7, 0.03, 0.008


def transitions() -> torch.Tensor:
    """(V, V) next-token probabilities given the last token."""
    V = TOK.vocab_size
    T = torch.full((V, V), 1e-6)
    ids = {ch: TOK.encode(ch, add_bos=False)[0] for ch in "=" + SHORT + LONG}
    eos = TOK.eos_token_id
    for tok in range(V):
        T[tok, eos] = 1.0  # specials: end at once
    for ch in "=":
        T[ids[ch]] = 1e-6
        for s in SHORT:
            T[ids[ch], ids[s]] = P_SHORT / len(SHORT)
        for s in LONG:
            T[ids[ch], ids[s]] = (1 - P_SHORT) / len(LONG)
    for mode, hazard in ((SHORT, HAZARD_SHORT), (LONG, HAZARD_LONG)):
        for ch in mode:
            T[ids[ch]] = 1e-6
            T[ids[ch], eos] = hazard
            for s in mode:
                T[ids[ch], ids[s]] = (1 - hazard) / len(mode)
    return T / T.sum(-1, keepdim=True)


def length_sampler(path: Path, layers: int = 1, E: int = 16) -> Path:
    """The Markov-chain policy (``layers`` decoder layers that start as the identity, hidden size ``E``), saved as
    a committed model dir."""
    V = TOK.vocab_size
    cfg = ModelConfig(
        model_type="qwen2", vocab_size=V, hidden_size=E, intermediate_size=2 * E, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=E // 4, qkv_bias=True,
        max_position_embeddings=CAP + 16, rope_theta=1000.0,
        bos_token_id=TOK.bos_token_id, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id,
    )  # fmt: skip
    m = Transformer(cfg).init_weights(seed=0)
    with torch.no_grad():
        m.model.embed_tokens.weight.zero_()
        m.model.embed_tokens.weight[:, :V] = torch.eye(V)  # RMSNorm makes it sqrt(E) * one-hot
        m.model.norm.weight.fill_(1.0)
        for layer in m.model.layers:  # the layer starts as the identity (its outputs zero); training moves it
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.zero_()
        m.lm_head.weight[:, :V] = transitions().log().T / math.sqrt(E)
    return save_pretrained(m, path)


def ends_in_c(prompt: str, completion: str, **_) -> float:
    return float(completion.endswith("c"))


def shape(model: Path, rows: int = 512) -> dict:
    """The length distribution the sampler draws from (before training)."""
    from align.model import load_pretrained

    params = SamplingParams(n=rows, max_tokens=CAP, seed=0, stop_token_ids=[TOK.eos_token_id])
    lens = sorted(len(c.token_ids) for c in generate(load_pretrained(model), [TOK.encode("ab=")], params))
    return {"median": lens[len(lens) // 2], "p90": lens[int(0.9 * len(lens))], "at_cap": sum(n >= CAP for n in lens) / len(lens)}  # fmt: skip


def sampler_alone(model: Path, args: argparse.Namespace) -> tuple[float, float]:
    """Generation seconds per step of the sampler alone (no trainer, no rewards, one version): ``generate`` of B
    groups vs the partial carry's call (2B groups, stop at B complete, the rest carried), over ``args.steps`` steps;
    interleaved ``args.repeats`` times, the medians."""
    from align.model import load_pretrained
    from align.rollout.client import NativeClient

    client = NativeClient(load_pretrained(model))
    params = SamplingParams(n=args.group_size, max_tokens=CAP, stop_token_ids=[TOK.eos_token_id])
    encoded = [TOK.encode(p["prompt"]) for p in prompts(64, 1)]
    plain, part = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for t in range(args.steps):
            client.generate(
                [encoded[(t * args.prompts + i) % 64] for i in range(args.prompts)], replace(params, seed=t)
            )
        plain.append((time.perf_counter() - t0) / args.steps)
        carry, drawn = partial.Carry(args.group_size, None, "drop"), [0]

        def next_prompts(k: int, drawn: list[int] = drawn) -> list[int]:
            drawn[0] += k
            return [(drawn[0] - k + i) % 64 for i in range(k)]

        t0 = time.perf_counter()
        for t in range(args.steps):
            carry.draw(t + 1, args.prompts, next_prompts, encoded.__getitem__, replace(params, seed=t), client)
        part.append((time.perf_counter() - t0) / args.steps)
    return sorted(plain)[len(plain) // 2], sorted(part)[len(part) // 2]


def prompts(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": "".join("abcd"[int(i)] for i in torch.randint(0, 4, (3,), generator=g)) + "="} for _ in range(n)]


def run(name: str, args: argparse.Namespace, model: Path, tmp: Path, lags: Counter, **kw) -> dict:
    import json

    cfg = TrainConfig(
        out=str(tmp / name), steps=args.steps, prompts_per_step=args.prompts, group_size=args.group_size,
        max_tokens=CAP, lr=args.lr, warmup_steps=0, micro_batch_size=64, max_async_steps=1, checkpoint_every=0,
        seed=args.seed, **kw,
    )  # fmt: skip
    cfg.eval.eval_interval, cfg.eval.eval_n = args.steps, args.eval_n
    cfg.log.log_completions_every = 0
    real = partial.lag_metrics

    def counting(completions, t):  # the token-lag histogram, from what the pipeline measures
        lags.update((t - 1) - v for c in completions for v in partial.versions_of(c))
        return real(completions, t)

    partial.lag_metrics = counting
    try:
        t0 = time.perf_counter()
        train(cfg, model=str(model), tokenizer=TOK, prompts=prompts(64, 1), reward=ends_in_c,
              eval_prompts=prompts(args.eval_prompts, 2))  # fmt: skip
        wall = time.perf_counter() - t0
    finally:
        partial.lag_metrics = real
    recs = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "step_time" in r and r["step"] > 1]
    loop = sum(r["step_time"] for r in steps)
    idle = sum(r.get("async/generator_idle_s", 0.0) for r in steps)
    evals = [r for r in recs if "eval/pass@1" in r]
    return {
        "steps_per_s": len(steps) / loop,
        "idle_frac": idle / loop,
        "pass@1": evals[-1]["eval/pass@1"] if evals else float("nan"),
        "len_mean": sum(r["completion_len_mean"] for r in steps) / len(steps),
        "gen_s": sum(r["rollout_time"] for r in steps) / len(steps),  # the producer's generate + score, per step
        "wall_s": wall,
    }


def median_run(rs: list[dict]) -> dict:
    return {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    numeric_flags(ap, steps=16, prompts=8, group_size=4, lr=3e-4, eval_prompts=32, eval_n=4, seed=0)
    ap.add_argument("--layers", type=int, default=1, help="decoder layers (identity at the start): decode cost")
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs per setting (interleaved); the median is printed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = length_sampler(tmp / "model", args.layers, args.hidden)
        s = shape(model)
        print(f"completion lengths: median {s['median']}, p90 {s['p90']}, cap {CAP} ({s['at_cap']:.0%} at the cap)")
        gen, cut = sampler_alone(model, args)
        print(
            f"sampler alone, s/step of {args.prompts} groups of {args.group_size}: generate {gen:.3f}, partial "
            f"{cut:.3f} ({gen / cut:.2f}x)"
        )
        lags: Counter = Counter()
        runs: dict[str, list[dict]] = {"without": [], "--partial-rollouts": []}
        run("warmup", argparse.Namespace(**{**vars(args), "steps": 3}), model, tmp, Counter(), partial_rollouts=True)
        for i in range(args.repeats):  # interleaved, alternating order: a load change on the machine hits both alike
            order = ("without", "--partial-rollouts") if i % 2 == 0 else ("--partial-rollouts", "without")
            for name in order:
                kw = {"partial_rollouts": True} if name != "without" else {}
                runs[name].append(run(f"{name.strip('-')}{i}", args, model, tmp, lags if kw else Counter(), **kw))
    base, part = (median_run(runs[k]) for k in runs)
    print(
        f"native, K=1, {args.steps} steps x {args.prompts} groups of {args.group_size}, median of {args.repeats} run(s):"
    )
    print(f"{'':<22}{'steps/s':>9}{'gen idle':>10}{'gen s/step':>12}{'pass@1':>8}{'len mean':>10}")
    for name, r in (("without", base), ("--partial-rollouts", part)):
        print(
            f"{name:<22}{r['steps_per_s']:>9.3f}{r['idle_frac']:>10.1%}{r['gen_s']:>12.3f}{r['pass@1']:>8.3f}"
            f"{r['len_mean']:>10.1f}"
        )
    print(
        f"ratio with --partial-rollouts: {part['steps_per_s'] / base['steps_per_s']:.2f}x steps/s, "
        f"{base['gen_s'] / part['gen_s']:.2f}x less generation time per step"
    )
    total = sum(lags.values())
    print("token lag (versions behind the step's trainer weights), share of trained tokens:")
    for lag in sorted(lags):
        print(f"  {lag:>3}: {lags[lag] / total:6.1%} {'#' * round(50 * lags[lag] / total)}")


if __name__ == "__main__":
    main()
