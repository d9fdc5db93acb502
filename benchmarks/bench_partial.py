"""Partial rollouts (--partial-rollouts): steps/s, the generator's idle fraction and held-out pass@1 with and
without them, side by side in one run, on completions with a long-tailed length distribution; and the token-lag
histogram of the partial run.

    .venv/bin/python benchmarks/bench_partial.py [--steps 12] [--prompts 8] [--group-size 4] [--backend spool]
    python3 benchmarks/bench_partial.py --device cuda --scale 100 --steps 8 --repeats 1   # a GPU, real lengths

The length sampler: a policy whose next-token distribution is a Markov chain on the last token (decoder layers
whose output projections start at zero, so the residual stream is the one-hot embedding, which the final norm
carries into an lm_head holding the log transition matrix), so the lengths follow a chosen shape, decoding costs
what ``--layers`` x ``--hidden`` x ``--heads`` cost, and training still moves it. The default shape (1 x 16, one
head of 16) keeps a decode step's cost nearly flat in the number of rows (per-step overhead: 2x the rows, 1.19x the
step), the regime of a GPU's memory-bound decode that partial rollouts are for: the call's length in steps is what
they shorten, while the pool holds 2x the rows. ``--heads 4`` (4 heads of 4, the default until session 22) is not
flat: the fused decode attention runs a head size of 4 on its scalar path (~4 us a row per step; 2x the rows,
1.6x the step). A
compute-bound CPU shape (``--layers 4 --hidden 64``) pays per row, so the extra rows eat most of the gain. After the prompt's ``=`` a row enters a "short" mode
(tokens a-d, <eos> hazard 3% per token) with probability 0.7 or a "long" mode (w-z, hazard 0.8%): median ~32,
p90 ~140, ~8% at the 160-token cap (seed 003's Goedel-Prover-V2-8B shape, 3.2k : 14k : 16k, scaled down 100x).
The reward: 1 when the completion's last token before <eos> is ``c`` (pass@1 ~ 0.2 at the start). Native sampler,
--max-async-steps 1, the sampler-alone loops on one torch thread, the runs on the run default (every CPU; the
generation thread on half of them, the trainer on the rest: ``engines.NativeEngine``); each run trains a fresh copy of the same model
with the same prompts and seeds; only --partial-rollouts differs, and on the native sampler its two --partial-prefill modes run side by side
(recompute: a cut row re-prefilled under the new weights; keep: it continues on its KV cache), and each again with
``--partial-cut publish`` (the carried rows decode while the producer waits for the trainer's publish; "fill tok/step":
the tokens they got so) (a short warm-up run
first; then --repeats runs of each, interleaved in rotating order; the median of each figure). Printed: steps/s over the steps after the first, the generator's idle
fraction (its wait for the trainer / the loop time), the producer's generate + score seconds per step
(``rollout_time``), the trainer's wait fraction (blocked on its batch / the loop time) and its own seconds per
step (the loop minus that wait: the bound on steps/s once generation is faster), the producer thread's CPU
seconds per step (less moved by the machine's load than wall time), held-out pass@1 after the last step, the
ratios, and the histogram of the partial runs' token lags; then the trainer's seconds per step alone (a
synchronous run's step minus its generation, ``--max-async-steps 0``, one per repeat) and the steps/s the sampler
and trainer would give side by side in parallel (1 / the larger) or serialized (1 / the sum: what the
interpreter lock makes of two threads that spend their time in Python between small ops). The sampler-alone line also gives a call's length in
decode steps (the most tokens a row got in it) and the wall time per decode step, plain vs partial: partial
rollouts shorten the call in steps, and what a step costs decides how much of that reaches the clock.

``--device cuda --scale 100`` (``scripts/gpu_check.sh``, step 7): the same bench on a GPU at seed 003's own lengths
(median ~3.2k, p90 ~14k, cap 16k): the trainer and the native sampler on the GPU (its decode steps CUDA-graph
replays, whose cost is flat in the rows: the regime partial rollouts are for); ``--scale S`` scales the lengths on
any device.

``--backend spool``: (b), the same comparison through the vLLM CPU worker (``--rollout spool``): one worker process
(``.venv-rollout``, in-process engine, one OpenMP thread bound to the second core) serves every run, attached with
``spawn_worker=False`` as in benchmarks/bench_async.py; the trainer runs on the first core. vLLM's CPU attention
needs a head size of 32 or more, so the length sampler is 1 x 128 there (``--hidden`` overrides) and the default lr 3e-5. With the spool the
cut is the worker's ``cut`` request and a carried row resumes as prompt + ids so far (prefix cache). ``--async-steps
K`` (default 1) sets ``--max-async-steps`` for both settings; ``--pool-factor F`` the pool a partial call holds (F x
the groups a step needs: ``--partial-pool-factor``, default 2).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from common import numeric_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
__import__("align")  # before torch, as a run imports it: OpenMP threads sleep when idle (align/__init__.py)

import torch

from align.char_tokenizer import CharTokenizer
from align.model import ModelConfig, Transformer, save_pretrained
from align.rollout import partial
from align.rollout.native import generate
from align.rollout.pipeline import RolloutPipeline
from align.rollout.protocol import SamplingParams
from align.train import TrainConfig, train

TOK = CharTokenizer("=abcdwxyz")
CAP = 160
SHORT, LONG = "abcd", "wxyz"
P_SHORT, HAZARD_SHORT, HAZARD_LONG = 0.7, 0.03, 0.008
PREFILLS = {"native": ("recompute", "keep"), "spool": ("recompute",)}  # --partial-prefill modes each backend has


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


def length_sampler(path: Path, layers: int = 1, E: int = 16, heads: int = 1) -> Path:
    """The Markov-chain policy (``layers`` decoder layers that start as the identity, hidden size ``E``, ``heads``
    query heads of E / heads and half as many kv heads), saved as a committed model dir."""
    V = TOK.vocab_size
    cfg = ModelConfig(
        model_type="qwen2", vocab_size=V, hidden_size=E, intermediate_size=2 * E, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=E // heads, qkv_bias=True,
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


def set_scale(scale: int) -> None:
    """``--scale S``: the lengths S x the default shape's (the cap 160 S, the <eos> hazards / S; S = 100 is seed
    003's own lengths, 3.2k : 14k : 16k)."""
    global CAP, HAZARD_SHORT, HAZARD_LONG
    CAP, HAZARD_SHORT, HAZARD_LONG = 160 * scale, 0.03 / scale, 0.008 / scale


def shape(model: Path, device: str, rows: int = 512) -> dict:
    """The length distribution the sampler draws from (before training)."""
    from align.model import load_pretrained

    params = SamplingParams(n=rows, max_tokens=CAP, seed=0, stop_token_ids=[TOK.eos_token_id])
    lens = sorted(len(c.token_ids) for c in generate(load_pretrained(model, device), [TOK.encode("ab=")], params))
    return {"median": lens[len(lens) // 2], "p90": lens[int(0.9 * len(lens))], "at_cap": sum(n >= CAP for n in lens) / len(lens)}  # fmt: skip


class Counted:
    """The bench's view of a sampler client's calls: each call's length in decode steps (the most tokens a row
    got in it) and its CPU seconds (this thread's: far less moved by the machine's load than wall time)."""

    def __init__(self, client) -> None:
        self.client, self.calls = client, []  # (decode steps, cpu s)

    def generate(self, prompts, params):
        c0 = time.thread_time()
        out = self.client.generate(prompts, params)
        self.calls.append((max(len(c.token_ids) for c in out), time.thread_time() - c0))
        return out

    def generate_until(self, prompts, params, need, carried, **kw):
        c0 = time.thread_time()
        out = self.client.generate_until(prompts, params, need, carried, **kw)
        new = [len(o.token_ids) - (len(c.token_ids) if c is not None else 0) for o, c in zip(out, carried)]
        self.calls.append((max(new), time.thread_time() - c0))
        return out

    def take(self) -> tuple[float, float]:
        """(decode steps, CPU s) per call since the last take."""
        calls, self.calls = self.calls or [(0, 0.0)], []
        return sum(n for n, _ in calls) / len(calls), sum(s for _, s in calls) / len(calls)


def sampler_alone(client, args: argparse.Namespace) -> tuple[tuple[float, ...], dict]:
    """Generation seconds per step of the sampler alone (no trainer, no rewards, one version): ``generate`` of B
    groups vs the partial carry's call (2B groups, stop at B complete, the rest carried; each ``--partial-prefill``
    the backend has: recompute, and keep on the native sampler), over ``args.steps`` steps, and ``generate`` of 2B
    groups (the pool's rows run to the end: what holding 2x the rows costs); interleaved ``args.repeats`` times
    (after one warm-up call), the medians: (plain, recompute, double[, keep]); and, for plain and recompute, the
    medians of a call's length in decode steps and its CPU seconds (native only: a spool call's CPU is the
    worker's). ``client``: a NativeClient or a SpoolClient."""
    params = SamplingParams(n=args.group_size, max_tokens=CAP, stop_token_ids=[TOK.eos_token_id])
    encoded = [TOK.encode(p["prompt"]) for p in prompts(64, 1)]
    plain, part, double, keep = [], [], [], []
    counted = Counted(client)
    steps: dict[str, list[tuple[float, float]]] = {"generate": [], "partial": []}
    client.generate([encoded[0]], replace(params, seed=0))  # warm-up (the worker's first call compiles)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for t in range(args.steps):
            counted.generate(
                [encoded[(t * args.prompts + i) % 64] for i in range(args.prompts)], replace(params, seed=t)
            )
        plain.append((time.perf_counter() - t0) / args.steps)
        steps["generate"].append(counted.take())
        for mode, times in (("recompute", part), ("keep", keep))[: len(PREFILLS[args.backend])]:
            carry = partial.Carry(args.group_size, None, "drop", pool_factor=args.pool_factor, prefill=mode)
            drawn = [0]

            def next_prompts(k: int, drawn: list[int] = drawn) -> list[int]:
                drawn[0] += k
                return [(drawn[0] - k + i) % 64 for i in range(k)]

            t0 = time.perf_counter()
            for t in range(args.steps):
                carry.draw(t + 1, args.prompts, next_prompts, encoded.__getitem__, replace(params, seed=t), counted)
            times.append((time.perf_counter() - t0) / args.steps)
            calls = counted.take()
            if mode == "recompute":
                steps["partial"].append(calls)
        t0 = time.perf_counter()
        for t in range(args.steps):
            B2 = args.pool_factor * args.prompts
            client.generate([encoded[(t * B2 + i) % 64] for i in range(B2)], replace(params, seed=t))
        double.append((time.perf_counter() - t0) / args.steps)
    med = {k: tuple(sorted(x[j] for x in v)[len(v) // 2] for j in range(2)) for k, v in steps.items()}
    return tuple(sorted(x)[len(x) // 2] for x in (plain, part, double, keep) if x), med


def sampler_client(backend: str, model: Path, tmp: Path, stack: contextlib.ExitStack, device: str = "cpu"):
    """The bench's sampler: the native one on the model, or a vLLM CPU worker on ``tmp/spool`` (spawned once, on
    the second core; this process then keeps the first) that every run attaches to."""
    from align.model import load_pretrained
    from align.rollout.client import NativeClient, make_rollout_client

    if backend == "native":
        return NativeClient(load_pretrained(model, device))
    from bench_async import spawn  # benchmarks/: the worker on one core, one OpenMP thread

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("bench_partial --backend spool needs 2 cores (one for the trainer, one for the worker)")
    TOK.save(model)
    worker = spawn(tmp / "spool", model, cores[1], CAP + 16)
    stack.callback(worker.shutdown, grace_s=5)
    os.sched_setaffinity(0, {cores[0]})  # after the spawn: the worker keeps its own core
    return make_rollout_client("spool", spool=tmp / "spool", timeout_s=600, worker=worker)


def prompts(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": "".join("abcd"[int(i)] for i in torch.randint(0, 4, (3,), generator=g)) + "="} for _ in range(n)]


def run(name: str, args: argparse.Namespace, model: Path, tmp: Path, lags: Counter, **kw) -> dict:
    import json

    if args.backend == "spool":  # attach to the bench's one worker (synced to this run's step-0 weights)
        kw = {**kw, "rollout": "spool", "spool": str(tmp / "spool"), "spawn_worker": False, "threads": 1}
    cfg = TrainConfig(
        out=str(tmp / name), steps=args.steps, prompts_per_step=args.prompts, group_size=args.group_size,
        max_tokens=CAP, lr=args.lr, warmup_steps=0, micro_batch_size=64, checkpoint_every=0, seed=args.seed,
        device=args.device,
        **{"max_async_steps": args.async_steps, **kw},
    )  # fmt: skip
    cfg.eval.eval_interval, cfg.eval.eval_n = args.steps, args.eval_n
    cfg.log.log_completions_every = 0
    real = partial.lag_metrics

    def counting(completions, t):  # the token-lag histogram, from what the pipeline measures
        lags.update((t - 1) - v for c in completions for v in partial.versions_of(c))
        return real(completions, t)

    partial.lag_metrics = counting
    produce, cpu = RolloutPipeline._produce, [0.0]

    def timed(pipe) -> None:  # the producer thread's CPU seconds (generate + score): load moves it less than wall
        c0 = time.thread_time()
        try:
            produce(pipe)
        finally:
            cpu[0] += time.thread_time() - c0

    RolloutPipeline._produce = timed
    try:
        t0 = time.perf_counter()
        train(cfg, model=str(model), tokenizer=TOK, prompts=prompts(64, 1), reward=ends_in_c,
              eval_prompts=prompts(args.eval_prompts, 2))  # fmt: skip
        wall = time.perf_counter() - t0
    finally:
        partial.lag_metrics, RolloutPipeline._produce = real, produce
    recs = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "step_time" in r and r["step"] > 1]
    loop = sum(r["step_time"] for r in steps)
    idle = sum(r.get("async/generator_idle_s", 0.0) for r in steps)
    wait = sum(r.get("async/trainer_wait_s", 0.0) for r in steps)
    evals = [r for r in recs if "eval/pass@1" in r]
    return {
        "steps_per_s": len(steps) / loop,
        "idle_frac": idle / loop,
        "pass@1": evals[-1]["eval/pass@1"] if evals else float("nan"),
        "len_mean": sum(r["completion_len_mean"] for r in steps) / len(steps),
        "gen_s": sum(r["rollout_time"] for r in steps) / len(steps),  # the producer's generate + score, per step
        "wait_frac": wait / loop,  # the trainer's wait for its batch: ~0 when the trainer is the bottleneck
        "train_s": (loop - wait) / len(steps),  # the trainer's own seconds per step (loss, backward, publish)
        "wall_s": wall,
        "gen_cpu": cpu[0] / args.steps,  # the producer's CPU seconds per step (every step, the first included)
        "fill": sum(r.get("rollout/fill_tokens", 0) for r in steps) / len(steps),  # --partial-cut publish
        # --max-async-steps 0 only: the trainer's seconds per step with nothing beside it (step - generate + score)
        "train_alone": sorted(r["step_time"] - r["rollout_time"] for r in steps)[len(steps) // 2],
    }


def median_run(rs: list[dict]) -> dict:
    return {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    numeric_flags(ap, steps=16, prompts=8, group_size=4, eval_prompts=32, eval_n=4, seed=0)
    ap.add_argument("--lr", type=float, default=None, help="default 3e-4 native, 3e-5 spool (1 x 128 learns faster)")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers (identity at the start): decode cost")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 16 native, 128 spool)")
    ap.add_argument("--heads", type=int, default=None, help="query heads of hidden / heads (default 1 native, 4 spool)")
    ap.add_argument("--backend", choices=("native", "spool"), default="native", help="(a) native or (b) vLLM worker")
    ap.add_argument("--async-steps", type=int, default=1, help="--max-async-steps K of both settings")
    ap.add_argument(
        "--pool-factor", type=int, default=partial.POOL_FACTOR, help="groups in a call / groups a step needs"
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per setting (interleaved); the median is printed")
    ap.add_argument("--scale", type=int, default=1, help="lengths x S (cap 160 S; 100: seed 003's real lengths)")
    ap.add_argument("--device", default="auto", help="the trainer's and the native sampler's: auto = CUDA if any")
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.scale < 1:
        ap.error(f"--scale must be >= 1, got {args.scale}")
    set_scale(args.scale)
    args.hidden = args.hidden or (128 if args.backend == "spool" else 16)
    args.heads = args.heads or (4 if args.backend == "spool" else 1)
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    args.lr = args.lr or (3e-5 if args.backend == "spool" else 3e-4)  # spool: at 3e-4 the long tail is gone by step 16
    torch.set_num_threads(1)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"device {args.device}, lengths x {args.scale}; load average at the start: {load}")
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        model = length_sampler(tmp / "model", args.layers, args.hidden, args.heads)
        s = shape(model, args.device)
        print(f"completion lengths: median {s['median']}, p90 {s['p90']}, cap {CAP} ({s['at_cap']:.0%} at the cap)")
        client = sampler_client(args.backend, model, tmp, stack, args.device)
        (gen, cut, gen2, *kept), calls = sampler_alone(client, args)
        print(
            f"sampler alone, s/step of {args.prompts} groups of {args.group_size}: generate {gen:.3f}, partial "
            f"(recompute) {cut:.3f} ({gen / cut:.2f}x)"
            + "".join(f", partial (keep) {k:.3f} ({gen / k:.2f}x)" for k in kept)
            + f"; generate of {args.pool_factor * args.prompts} groups to the end {gen2:.3f} ({gen2 / gen:.2f}x the "
            "rows' cost)"
        )
        (n0, c0), (n1, c1) = calls["generate"], calls["partial"]
        print(
            f"a call's length: generate {n0:.1f} decode steps, partial (recompute) {n1:.1f} ({n0 / n1:.2f}x fewer); "
            f"wall s per decode step {gen / n0 * 1e3:.2f} vs {cut / n1 * 1e3:.2f} ms ({cut / n1 / (gen / n0):.2f}x)"
            + (f"; CPU s per call {c0:.3f} vs {c1:.3f} ({c0 / c1:.2f}x)" if args.backend == "native" else "")
        )
        lags: Counter = Counter()
        modes = PREFILLS[args.backend]  # the --partial-prefill modes; then each with --partial-cut publish
        names = ["without"] + [f"partial, {m}" for m in modes] + [f"partial, {m}, publish" for m in modes]
        runs: dict[str, list[dict]] = {name: [] for name in names}
        run("warmup", argparse.Namespace(**{**vars(args), "steps": 3}), model, tmp, Counter(), partial_rollouts=True)
        alone = [run(f"sync{i}", args, model, tmp, Counter(), max_async_steps=0) for i in range(args.repeats)]
        for i in range(args.repeats):  # interleaved, rotating order: a load change on the machine hits each alike
            for name in names[i % len(names) :] + names[: i % len(names)]:
                kw = {}
                if name != "without":
                    mode, when = name.split(", ")[1], "publish" if name.endswith("publish") else "groups"
                    kw = {"partial_rollouts": True, "partial_pool_factor": args.pool_factor, "partial_prefill": mode}
                    kw["partial_cut"] = when
                tag = name.replace(", ", "_").replace(" ", "")
                runs[name].append(run(f"{tag}{i}", args, model, tmp, lags if kw else Counter(), **kw))
    medians = {name: median_run(rs) for name, rs in runs.items()}
    base = medians["without"]
    print(
        f"{args.backend}, K={args.async_steps}, pool factor {args.pool_factor}, {args.steps} steps x {args.prompts} groups of {args.group_size}, median of {args.repeats} run(s):"
    )
    head = ("steps/s", "gen idle", "gen s/step", "gen cpu/step", "train wait", "train s/step", "pass@1", "len mean")
    print(f"{'':<28}" + "".join(f"{h:>13}" for h in head) + f"{'fill tok/step':>14}")
    for name, r in medians.items():
        print(
            f"{name:<28}{r['steps_per_s']:>13.3f}{r['idle_frac']:>13.1%}{r['gen_s']:>13.3f}{r['gen_cpu']:>13.3f}"
            f"{r['wait_frac']:>13.1%}"
            f"{r['train_s']:>13.3f}{r['pass@1']:>13.3f}{r['len_mean']:>13.1f}{r['fill']:>14.1f}"
        )
    for name, r in list(medians.items())[1:]:
        print(
            f"ratio {name} / without: {r['steps_per_s'] / base['steps_per_s']:.2f}x steps/s, "
            f"{base['gen_s'] / r['gen_s']:.2f}x less generation time per step, "
            f"{base['gen_cpu'] / r['gen_cpu']:.2f}x less producer CPU per step"
        )
    tr = median_run(alone)["train_alone"]  # the trainer alone: a synchronous run's step minus its generation
    print(
        f"the trainer alone (a --max-async-steps 0 run's step minus its generate + score): {tr:.3f} s/step. Beside "
        f"the sampler in one process, steps/s would be 1 / max(sampler alone, trainer alone) if the two ran in "
        f"parallel, 1 / (sampler alone + trainer alone) if one interpreter lock serialized them: without "
        f"{1 / max(gen, tr):.2f} / {1 / (gen + tr):.2f}, partial (recompute) {1 / max(cut, tr):.2f} / "
        f"{1 / (cut + tr):.2f}" + "".join(f", partial (keep) {1 / max(k, tr):.2f} / {1 / (k + tr):.2f}" for k in kept)
    )
    if "partial, keep" in medians:
        k, rc = medians["partial, keep"], medians["partial, recompute"]
        print(f"ratio keep / recompute: {k['steps_per_s'] / rc['steps_per_s']:.2f}x steps/s")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    total = sum(lags.values())
    print("token lag (versions behind the step's trainer weights), share of trained tokens (every partial run):")
    for lag in sorted(lags):
        print(f"  {lag:>3}: {lags[lag] / total:6.1%} {'#' * round(50 * lags[lag] / total)}")


if __name__ == "__main__":
    main()
