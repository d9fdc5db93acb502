"""On-policy distillation on the built-in reverse task: (b) steps to a held-out pass@1 target, ``--distill-only`` from
a GRPO-trained teacher vs GRPO, from the same warm start; (c) the teacher's scoring cost per step, in process vs a
vLLM spool worker.

    # the teacher: the default GRPO run of the built-in task (100 steps), exported as an HF dir
    .venv/bin/python -m align.train --out /tmp/distill_teacher --save-hf /tmp/distill_teacher_hf
    .venv/bin/python benchmarks/bench_distill.py --teacher /tmp/distill_teacher_hf \\
        --student /tmp/distill_teacher/base_model [--grpo-steps 80] [--distill-steps 40] [--skip-worker]

(b) Both runs start from ``--student`` (the teacher run's warm start), with the task's defaults (32 prompts x 8
completions per step, the same seed, so the same prompts per step) and a held-out eval (200 words, 4 samples at
T = 1) every ``--eval-interval`` steps; printed side by side: both pass@1 curves, and for 0.70, 0.75, 0.80 and
``--target`` the first evaluated step at or above it for each and their ratio (distillation / GRPO).
``--teacher-coef``, ``--distill-lr`` and ``--with-reward`` (the teacher signal added to GRPO's rather than alone) vary
the distillation run, ``--grpo-lr`` the GRPO run (each method at its own best lr), ``--skip-grpo`` runs distillation
alone. ``--weak-start-steps N`` adds both runs from a weaker start, where GRPO's reward is sparse: the task's
supervised warm start cut to N steps (seed 0; 200 steps: held-out pass@1 0.07 vs the default 800 steps' 0.35), both
runs ``--weak-cap`` steps (a target not reached by then is printed as such); with both starts a last table puts them
side by side (``--skip-default-start``: the weak start's runs only). (c) One step's batch (the student's samples of
32 x 8 prompts) scored ``--repeats`` times by the frozen teacher in this process and by a vLLM CPU worker (fp32, in-process engine)
through ``score`` requests; printed: the median seconds per step of each and their ratio (the worker's start
excluded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import numeric_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from align.tasks import reverse
from align.train import TrainConfig, train

THRESHOLDS = (0.7, 0.75, 0.8)  # (b): the pass@1 levels reported below --target


def pass_curve(out: Path) -> list[tuple[int, float]]:
    """Every (step, held-out pass@1) of the run in ``out``."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval/pass@1"]) for r in recs if "eval/pass@1" in r]


def run(out: Path, student: str, steps: int, args: argparse.Namespace, teacher: str | None) -> float:
    """One training run from ``student``: GRPO (``teacher`` None) or distillation with the flags' coef, lr, reward."""
    lr = (args.distill_lr if teacher is not None else args.grpo_lr) or TrainConfig.lr
    cfg = TrainConfig(out=str(out), model=student, steps=steps, checkpoint_every=0, lr=lr, threads=args.threads)
    cfg.eval.eval_interval = args.eval_interval
    if teacher is not None:
        cfg.distill.teacher, cfg.distill.teacher_coef = teacher, args.teacher_coef
        cfg.distill.distill_only = not args.with_reward
    t0 = time.monotonic()
    train(cfg)
    return time.monotonic() - t0


def first_steps(curves: dict[str, list[tuple[int, float]]], target: float) -> dict[float, dict[str, int | None]]:
    """For 0.70, 0.75, 0.80 and ``target``: each run's first evaluated step at or above it (None: not reached)."""
    return {
        t: {n: next((s for s, v in c if v >= t), None) for n, c in curves.items()}
        for t in sorted({*THRESHOLDS, target})
    }


def ratio(first: dict[str, int | None]) -> str:
    """The distillation / GRPO ratio of the steps to one threshold, or why there is none."""
    d, g = first.get("distill"), first.get("grpo")
    return f"{d / g:.2f}x" if d and g else "n/a (not reached)"


def side_by_side(
    curves: dict[str, list[tuple[int, float]]], args: argparse.Namespace, start: str
) -> tuple[float, dict[float, dict[str, int | None]]]:
    """(b)'s figures of both runs from one start in one table: pass@1 per evaluated step, then the first step at or
    above each threshold up to ``--target`` and the distillation / GRPO ratio of those steps. Returns the start's
    pass@1 (step 0) and those first steps."""
    lr = args.distill_lr or TrainConfig.lr
    what = f"{'GRPO + teacher' if args.with_reward else 'distill-only'} (coef {args.teacher_coef}, lr {lr})"
    names = list(curves)
    print(f"(b) {start} start: held-out pass@1 per step: {what} vs GRPO (lr {args.grpo_lr or TrainConfig.lr})")
    print("(b) step | " + " | ".join(names))
    by_step = {n: dict(c) for n, c in curves.items()}
    for step in sorted({s for c in curves.values() for s, _ in c}):
        print(f"(b) {step:4d} | " + " | ".join(f"{by_step[n].get(step, float('nan')):.3f}" for n in names))
    firsts = first_steps(curves, args.target)
    for target, first in firsts.items():
        print(f"(b) {start} start, first step >= {target}: " + ", ".join(f"{n} {first[n]}" for n in names)
              + f" | ratio {ratio(first)}", flush=True)  # fmt: skip
    return by_step[names[0]].get(0, float("nan")), firsts


def summary(starts: dict[str, tuple[float, dict[float, dict[str, int | None]]]]) -> None:
    """One line per start, side by side: its pass@1 and, per threshold, the steps of both runs ("-": not reached
    within the run) and their ratio."""
    targets = sorted({t for _, firsts in starts.values() for t in firsts})
    print("(b) start (pass@1) | " + " | ".join(f"to {t}: distill / grpo (ratio)" for t in targets))
    for label, (p0, firsts) in starts.items():
        cells = [" / ".join(str(firsts[t].get(n) or "-") for n in ("distill", "grpo")) + f" ({ratio(firsts[t])})"
                 for t in targets]  # fmt: skip
        print(f"(b) {label} ({p0:.3f}) | " + " | ".join(cells), flush=True)


def scoring_cost(student: str, teacher: str, repeats: int, work: Path, skip_worker: bool) -> None:
    from align.learner import StepBatch, make_batch
    from align.model import load_pretrained
    from align.rollout.client import make_rollout_client, spawn_worker
    from align.rollout.native import generate
    from align.rollout.protocol import SamplingParams
    from align.run.teacher import InProcessTeacher, WorkerTeacher

    tok = reverse.tokenizer()
    cfg = TrainConfig(out=str(work / "c"))
    P, G = cfg.prompts_per_step, cfg.group_size
    prompts = [tok.encode(p["prompt"]) for p in reverse.prompts(P, "train")]
    params = SamplingParams(n=G, max_tokens=12, stop_token_ids=[tok.eos_token_id], seed=0)
    comps = generate(load_pretrained(student), prompts, params)
    batch = make_batch(StepBatch(prompts, comps, torch.zeros(P, G), torch.ones(P, G, dtype=torch.bool)), cfg, "cpu")

    def median_s(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    native = InProcessTeacher(load_pretrained(teacher))
    t_native = median_s(lambda: native(batch, cfg, None, None))
    print(f"(c) in-process teacher: {t_native * 1e3:.1f} ms per step ({P * G} completions, "
          f"{int(batch.mask.sum())} scored tokens)", flush=True)  # fmt: skip
    if skip_worker:
        return
    worker = spawn_worker(work / "spool", log_path=work / "worker.log", model=teacher, max_model_len=32,
                          dtype="float32", in_process=True)  # fmt: skip
    try:
        client = make_rollout_client("spool", spool=work / "spool", timeout_s=600, worker=worker)
        remote = WorkerTeacher(client)
        t_worker = median_s(lambda: remote(batch, cfg, None, None))
        diff = float((remote(batch, cfg, None, None) - native(batch, cfg, None, None))[batch.mask].abs().max())
    finally:
        worker.shutdown()
    print(f"(c) vLLM worker teacher: {t_worker * 1e3:.1f} ms per step (score requests); worker / in-process = "
          f"{t_worker / t_native:.2f}x; max |logprob difference| {diff:.1e}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", required=True, help="the GRPO-trained teacher (an HF dir with align_tokenizer.json)")
    ap.add_argument("--student", required=True, help="the warm start both runs train from")
    numeric_flags(ap, grpo_steps=80, distill_steps=40, eval_interval=5, target=0.85, repeats=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads of the runs and of (c) (0: auto)")
    ap.add_argument("--teacher-coef", type=float, default=1.0, help="(b): the distillation run's --teacher-coef")
    ap.add_argument("--distill-lr", type=float, default=0.0, help="(b): the distillation run's --lr (0: the default)")
    ap.add_argument("--grpo-lr", type=float, default=0.0, help="(b): the GRPO run's --lr (0: the default)")
    ap.add_argument("--with-reward", action="store_true", help="(b): the teacher signal added to GRPO's, not alone")
    ap.add_argument("--skip-grpo", action="store_true", help="(b): the distillation run only")
    ap.add_argument(
        "--weak-start-steps",
        type=int,
        default=0,
        help="(b): also both runs from a warm start of this many supervised steps (0: none)",
    )
    ap.add_argument("--weak-cap", type=int, default=120, help="(b): the steps of both runs from the weak start")
    ap.add_argument("--skip-default-start", action="store_true", help="(b): the weak start's runs only")
    ap.add_argument("--skip-b", action="store_true", help="only (c)")
    ap.add_argument("--skip-worker", action="store_true", help="(c) without the vLLM worker")
    args = ap.parse_args()
    if args.weak_start_steps < 0 or args.weak_cap < 1:
        ap.error("--weak-start-steps must be >= 0 (0: no weak start) and --weak-cap >= 1")
    if args.skip_default_start and not args.weak_start_steps:
        ap.error("--skip-default-start leaves no run for (b): give --weak-start-steps N (or drop the flag)")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_distill_") as tmp:
        work = Path(tmp)
        if not args.skip_b:
            starts = [] if args.skip_default_start else [("default", args.student, args.grpo_steps, args.distill_steps)]
            if args.weak_start_steps:
                weak = str(reverse.warm_start(work / "weak_start", steps=args.weak_start_steps, log=None))
                starts.append((f"weak ({args.weak_start_steps} warm-start steps)", weak, args.weak_cap, args.weak_cap))
            firsts = {}
            for label, student, grpo_steps, distill_steps in starts:
                curves = {}
                runs = [("distill", args.teacher, distill_steps), ("grpo", None, grpo_steps)]
                for name, teacher, steps in runs[: 1 if args.skip_grpo else 2]:
                    out = work / f"{len(firsts)}_{name}"
                    wall = run(out, student, steps, args, teacher)
                    curves[name] = pass_curve(out)
                    print(f"(b) {label} start, {name}: wall {wall:.0f} s", flush=True)
                firsts[label] = side_by_side(curves, args, label)
            if len(firsts) > 1:
                summary(firsts)
        scoring_cost(args.student, args.teacher, args.repeats, work, args.skip_worker)


if __name__ == "__main__":
    main()
