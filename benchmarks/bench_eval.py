"""Benchmark: training-loop time per step with blocking eval vs snapshot eval on an eval fleet, same interval.

    python benchmarks/bench_eval.py --out runs/eval_bench --steps 12 --eval-interval 2

Trains the built-in task twice from the same warm-started model, side by side in one invocation:

- ``blocking``: ``--eval-interval N`` only, the in-process eval runs inside the loop;
- ``fleet``: ``--eval-interval N --eval-num-gpus 1 --eval-hf-dir ...``, the loop only exports the snapshot.

Per run it prints the loop time per step (``step_time`` of the GRPO step plus what eval cost the loop,
``eval/train_blocked_seconds``: the whole blocking eval, or the snapshot export plus any backpressure wait), the
eval's own duration, and how many steps late the snapshot evals landed. On a shared CPU only the ratio between
the two runs means something (absolute times are noise). Needs ``.venv-rollout`` for the fleet run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import numeric_flags


def run(out: Path, model: str | None, steps: int, interval: int, fleet: bool, args: argparse.Namespace) -> dict:
    from align.eval.config import EvalConfig
    from align.train import TrainConfig, train

    eval_cfg = EvalConfig(
        eval_interval=interval,
        eval_num_gpus=1 if fleet else 0,
        eval_hf_dir=str(out / "eval_hf") if fleet else None,
        eval_n=args.eval_n,
        ci_test=True,  # a skipped point would make the comparison meaningless
    )
    cfg = TrainConfig(
        out=str(out),
        model=model,
        steps=steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        eval_prompts=args.eval_prompts,
        warm_start_steps=args.warm_start_steps,
        checkpoint_every=0,
        eval=eval_cfg,
    )
    t0 = time.monotonic()
    train(cfg)
    wall = time.monotonic() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_recs = [r for r in records if "step_time" in r]
    evals = [r for r in records if "eval/train_blocked_seconds" in r]
    blocked = sum(r["eval/train_blocked_seconds"] for r in evals)
    return {
        "steps": len(step_recs),
        "grpo_step_s": statistics.mean(r["step_time"] for r in step_recs),
        "loop_s_per_step": (sum(r["step_time"] for r in step_recs) + blocked) / len(step_recs),
        "eval_points": len(evals),
        "blocked_s_per_point": blocked / max(len(evals), 1),
        "blocked_s_median": statistics.median(r["eval/train_blocked_seconds"] for r in evals) if evals else 0.0,
        "eval_duration_s": statistics.mean(r["eval/duration_seconds"] for r in evals) if evals else float("nan"),
        "lag_steps_max": max((r.get("eval/lag_steps", 0) for r in evals), default=0),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/eval_bench")
    numeric_flags(ap, steps=12, eval_interval=2, eval_prompts=200, eval_n=4)
    numeric_flags(ap, prompts_per_step=16, group_size=4, warm_start_steps=100)
    args = ap.parse_args(argv)
    root = Path(args.out)
    a = run(root / "blocking", None, args.steps, args.eval_interval, False, args)
    base = str(root / "blocking" / "base_model")  # the same warm-started model for both runs
    b = run(root / "fleet", base, args.steps, args.eval_interval, True, args)
    print(
        f"eval every {args.eval_interval} steps, {args.steps} steps, {args.eval_prompts} eval prompts x n={args.eval_n}"
    )
    print(f"{'':24}{'blocking':>12}{'fleet':>12}")
    keys = ("grpo_step_s", "loop_s_per_step", "blocked_s_per_point", "blocked_s_median", "eval_duration_s")
    for key in (*keys, "lag_steps_max", "wall_s"):
        print(f"{key:24}{a[key]:>12.3f}{b[key]:>12.3f}")
    print(f"loop time per step, fleet / blocking: {b['loop_s_per_step'] / a['loop_s_per_step']:.2f}")
    (root / "summary.json").write_text(json.dumps({"blocking": a, "fleet": b, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
