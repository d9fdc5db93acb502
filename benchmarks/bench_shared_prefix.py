"""One GRPO step's forward + backward (no optimizer), packed (``--pack-sequences``: each group's prompt once, no padding)
vs padded (``--no-pack-sequences``), side by side, fp32 on the CPU (bf16-mixed on CUDA):

  (a) long prompts:  4 prompts x G 8, prompts of 1024 tokens, completions lognormal (median 64, sigma 1) capped at 512
  (b) short answers: 32 prompts of 32 tokens x G 8, completions lognormal (median 24, sigma 1) capped at 512

on the 31M Qwen2 shape (8 layers, V 8192) and the Qwen2.5-0.5B shape with 2 layers (V 151936, tied), random weights.
Both paths run ``align.learner.backward_batch`` on the same batch (token-mean loss, random advantages) with the default
micro-batching (``--micro-batch-size 64``: the whole step in one forward per path), so the difference is the layout.
``--quick`` scales (a) to prompts of 256 tokens with completions capped at 128 and (b) to 8 prompts, for a small box.

Time: one child process runs the two paths alternating (padded first, then packed, ...), median of --reps after a
warm-up round. Memory beyond weights and gradients ("extra"): each path alone in a fresh child, peak resident set
(VmHWM, reset through /proc/self/clear_refs before the step) - RSS before - the gradients' bytes, with glibc's
MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave the RSS (as in bench_train_step.py). Neither tracemalloc (it
sees Python's allocator, not torch's) nor torch (no CPU allocator statistics in torch 2.13) counts torch's CPU tensors,
so the RSS peak is the measure here; on CUDA it is max_memory_allocated.

    .venv/bin/python benchmarks/bench_shared_prefix.py --quick          # both shapes, both cases, scaled down
    .venv/bin/python benchmarks/bench_shared_prefix.py --shape small    # the issue's sizes, the 31M shape
Targets (issue 28): (a) time <= 0.4x and extra memory <= 0.4x of padded; (b) time <= 0.85x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_train_step import MB, QWEN25_05B, step_extra_bytes

SMALL = {"model_type": "qwen2", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "qkv_bias": True,
         "max_position_embeddings": 4096}  # fmt: skip
SHAPES = {"small": SMALL, "qwen0.5b-2l": {**QWEN25_05B, "num_hidden_layers": 2}}
# case: (prompts, G, prompt tokens, completion median, cap); --quick: QUICK's
CASES = {"a": (4, 8, 1024, 64, 512), "b": (32, 8, 32, 24, 512)}
QUICK = {"a": (4, 8, 256, 64, 128), "b": (8, 8, 32, 24, 128)}
PATHS = ("padded", "packed")
SIGMA = 1.0  # the lognormal's sigma (of log length)


def build(args):
    import numpy as np
    import torch

    from align import learner
    from align.device import resolve
    from align.model import ModelConfig, Transformer
    from align.rollout.protocol import Completion
    from align.train import TrainConfig

    place = resolve(args.device, args.precision)
    if args.threads:
        torch.set_num_threads(args.threads)
    mcfg = ModelConfig(**SHAPES[args.shape])
    model = Transformer(mcfg).init_weights(seed=0).to(place.device, place.param_dtype).train()
    P, G, plen, median, cap = (QUICK if args.quick else CASES)[args.case]
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(median), SIGMA, P * G)), 1, cap).astype(int)
    prompts = [rng.integers(0, mcfg.vocab_size, plen).tolist() for _ in range(P)]
    comps = []
    for i, k in enumerate(lengths.tolist()):
        lp = (-rng.random(k) * 3).tolist()
        comps.append(Completion(prompt_index=i // G, sample_index=i % G, finish_reason="length", logprobs=lp,
                                token_ids=rng.integers(0, mcfg.vocab_size, k).tolist(), sampled_logprobs=lp))  # fmt: skip
    inputs, targets, mask, _, behav = learner.sequence_batch(prompts, comps, G, place.device)
    adv = torch.tensor(rng.standard_normal(P * G), dtype=torch.float32, device=place.device)
    batch = learner.Batch(inputs, targets, mask, adv, behav)
    cfgs = {path: TrainConfig(out="unused", prompts_per_step=P, group_size=G, max_tokens=cap, device=args.device,
                              micro_batch_size=64, pack_sequences=path == "packed") for path in PATHS}  # fmt: skip
    return place, model, batch, cfgs


def make_step(place, model, batch, cfg):
    import torch

    from align import learner

    def step() -> None:
        model.zero_grad(set_to_none=True)  # as a step's first micro-batch: backward allocates the grads
        learner.backward_batch(model, None, cfg, *batch, place=place)
        if place.device.type == "cuda":
            torch.cuda.synchronize(place.device)

    return step


def child_memory(args) -> dict:

    place, model, batch, cfgs = build(args)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    extra = step_extra_bytes(place, make_step(place, model, batch, cfgs[args.child]), grad_bytes)
    return {"extra_mb": extra / MB, "weights_mb": grad_bytes / MB}


def child_time(args) -> dict:
    from align import learner

    place, model, batch, cfgs = build(args)
    steps = {path: make_step(place, model, batch, cfgs[path]) for path in PATHS}
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for _ in range(args.reps + 1):  # the first round warms up
        for path in PATHS:
            t0 = time.perf_counter()
            steps[path]()
            times[path].append(time.perf_counter() - t0)
    lengths = learner.row_lengths(batch.mask)
    packed = learner.plan_micro_batches(batch.inputs, batch.mask, cfgs["packed"])
    return {
        **{path: statistics.median(t[1:]) for path, t in times.items()},
        "padded_tokens": len(lengths) * max(lengths),
        "packed_tokens": sum(r.tokens for r in packed),
        "scored": int(batch.mask.sum()),
    }


def run_case(args, argv: list[str]) -> dict:
    def child(what: str) -> dict:
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--shape", args.shape, "--case", args.case,
               "--child", what]  # fmt: skip
        env = dict(os.environ)
        if what != "time":  # memory: the RSS peak of live tensors, not of glibc's heap fragmentation
            env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        return json.loads(out.strip().splitlines()[-1])

    t = child("time")
    mem = {path: child(path) for path in PATHS}
    return {**t, **{f"{p}_mb": mem[p]["extra_mb"] for p in PATHS}, "weights_mb": mem["padded"]["weights_mb"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    p.add_argument("--case", choices=[*CASES, "all"], default="all")
    p.add_argument("--quick", action="store_true", help="smaller cases (see the docstring)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child_time(args) if args.child == "time" else child_memory(args)))
        return
    keep = [a for a in (argv if argv is not None else sys.argv[1:])]
    for flag in ("--shape", "--case"):  # the children get one shape and one case each
        while flag in keep:
            i = keep.index(flag)
            del keep[i : i + 2]
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus"
    print(f"shared-prefix packing: one forward + backward per path | {'--quick' if args.quick else 'full'} | {load}")
    print(f"{'shape':<12}{'case':<5}{'tokens padded/packed':>21}{'padded s':>10}{'packed s':>10}{'time x':>8}"
          f"{'padded MB':>11}{'packed MB':>11}{'mem x':>7}")  # fmt: skip
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    cases = list(CASES) if args.case == "all" else [args.case]
    for shape in shapes:
        for case in cases:
            args.shape, args.case = shape, case
            r = run_case(args, keep)
            print(f"{shape:<12}{case:<5}{r['padded_tokens']:>12}/{r['packed_tokens']:<8}{r['padded']:>10.2f}"
                  f"{r['packed']:>10.2f}{r['packed'] / r['padded']:>8.2f}{r['padded_mb']:>11.0f}{r['packed_mb']:>11.0f}"
                  f"{r['packed_mb'] / r['padded_mb']:>7.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
