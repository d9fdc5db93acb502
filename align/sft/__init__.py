"""Supervised fine-tuning: ``train()`` and the CLI ``python -m align.sft`` (settings: ``align.sft.config``).

One step, top to bottom: the step's rows (a seeded shuffle per epoch) -> teacher-forcing tensors -> the mean token
negative log-likelihood of the target tokens (``align.learner.nll_backward``: fused logprobs, no (N, V) logits,
micro-batches divided by the whole batch's target count, so micro-batching and torchrun ranks give the whole-batch
gradient) -> clip -> AdamW step -> log -> eval -> checkpoint. Setup is ``align.sft.run`` on a GRPO run's parts
(``align.run.parts``, ``align.run.policy``): the run directory, checkpoints and exact resume, torchrun/FSDP2, LoRA
and ``--save-hf`` are align.train's.

Rows (``align.sft.data``): ``messages`` (every assistant turn a target) or ``prompt`` + ``completion``, rendered
token-in/token-out through the model's chat template; or ``--from-verified GEN VERIF`` (expert iteration on the
Lean driver's verified samples, their sampled ids as they are).

Python API::

    from align.sft import SFTConfig, train
    train(SFTConfig(out="runs/sft", epochs=2), model="path/to/hf_dir", tokenizer=tok,
          rows=[{"prompt": "2+3=", "completion": "5"}, {"messages": [...]}], eval_rows=[...], reward=my_reward)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from align.sft.config import CLI_PREFIXES, SFTConfig

__all__ = ["SFTConfig", "main", "train"]


def train(
    cfg: SFTConfig,
    *,
    model: str | None = None,
    tokenizer: Any = None,
    rows: list | None = None,
    eval_rows: list | None = None,
    reward: Callable[..., float | None] | None = None,
    stop_flag: dict | None = None,
) -> dict:
    """Fine-tune; returns a summary dict. Resumes from the last committed checkpoint under ``cfg.out``.
    ``rows`` / ``eval_rows`` (dicts in a data file's formats) replace ``--train-data`` / ``--eval-data``;
    ``reward(prompt, completion, **fields)`` adds sampled pass@k to the eval. ``stop_flag``: as ``align.train``."""
    from align import dist, learner
    from align.sft.run import finite, mine, open_sft, tensors

    run = open_sft(
        cfg, model=model, tokenizer=tokenizer, rows=rows, eval_rows=eval_rows, reward=reward, stop_flag=stop_flag
    )
    cfg = run.cfg  # with the resolved number of steps
    with run:
        run.emit(run.evaluator.baseline(run.model_path, written=run.metrics.records, resumed=run.resumed))
        run.stop_flag["loop"] = True
        while run.step < cfg.steps:
            t0 = time.monotonic()
            run.policy.train()
            # 1. the step's rows -> this rank's share as tensors
            batch = [run.examples[i] for i in run.rows_for_step(run.step + 1)]
            # 2. loss / backward (global normaliser) -> clip -> AdamW (a non-finite loss or norm skips the step)
            run.opt.zero_grad(set_to_none=True)
            stats = learner.nll_backward(run.policy, cfg, *tensors(mine(batch), run.place.device), place=run.place)
            norm = learner.grad_norm(run.policy, cfg.grad_clip)
            skipped = not finite(stats["loss"], norm)
            if skipped:
                run.opt.zero_grad(set_to_none=True)
            else:
                run.opt.step()
            run.sched.step()
            run.step += 1
            # 3. log
            rec = {
                "step": run.step,
                "loss": stats["loss"],
                "num_tokens": stats["num_tokens"],
                "rows": len(batch),
                "epoch": run.cursor.state["epoch"],
                "lr": run.sched.get_last_lr()[0],
                "grad_norm": norm,
                "nonfinite_steps": int(skipped),
                "step_time": time.monotonic() - t0,
            }
            run.metrics.write(rec)
            run.progress.update(run.step, f"step {run.step} | loss {stats['loss']:.4g} | grad_norm {norm:.3g}")
            run.nonfinite.add(learner.Update(stats, norm, [], int(skipped)), run.step)
            # 4. eval and checkpoint: each decides its own cadence
            is_final = run.step == cfg.steps
            run.emit(run.evaluator.step(run.step, is_final))
            dist.agree_on_signal(run.stop_flag)
            run.checkpointer.save(run.step, last_step=is_final, force=bool(run.stop_flag.get("signal")))
            if run.stop_flag.get("signal"):
                break
    run.export_final()
    return {**run.summary(), **eval_loss(run.records)}


def eval_loss(records: list[dict]) -> dict:
    """The first and last eval/loss of a run (None without eval)."""
    losses = [r["eval/loss"] for r in records if "eval/loss" in r]
    return {"eval_loss_start": losses[0] if losses else None, "eval_loss_end": losses[-1] if losses else None}


def main(argv: list[str] | None = None) -> int:
    from align.run.cli import parse, run_main

    description = __doc__.split("\n\n")[0]
    parse_cfg = partial(parse, SFTConfig, argv, CLI_PREFIXES, description)
    return run_main("align.sft", parse_cfg, train, print_summary, usage_errors=(ValueError,))  # ValueError: --device


def print_summary(s: dict) -> None:
    acc = f"held-out pass@1 {s['eval_start']:.3f} -> {s['eval_end']:.3f} | " if s["eval_start"] is not None else ""
    loss = (
        f"eval loss {s['eval_loss_start']:.4f} -> {s['eval_loss_end']:.4f} | "
        if s["eval_loss_start"] is not None
        else ""
    )
    print(f"[align] sft done: {s['steps']} steps | {loss}{acc}wall {s['wall_s']:.0f}s | run dir {s['out']}", flush=True)
