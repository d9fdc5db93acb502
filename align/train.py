"""GRPO training: the training loop ``train()`` and the CLI ``python -m align.train`` (settings: ``align.run.config``).

One step, top to bottom: prompts -> rollouts (a rollout client: the native sampler, or a vLLM worker
through the spool) -> rewards -> group advantages -> micro-batched loss/backward with global
normalisers (so the micro-batch size never changes the gradient) -> clip -> AdamW step -> publish the weights
-> log -> eval -> checkpoint. Setup and teardown: ``align.run.build``. With no arguments it trains the built-in
``reverse`` task on a CPU in minutes (see ``align/tasks/reverse.py``).

Python API::

    from align.train import TrainConfig, train
    train(TrainConfig(out="runs/mine", steps=100), model="path/to/hf_dir", tokenizer=tok,
          prompts=[{"prompt": "...", "answer": "..."}, ...], reward=my_reward)

``reward(prompt, completion, **fields) -> float | None``: ``fields`` are the prompt dict's other keys;
``None``/NaN or an exception marks the completion unscorable (no gradient, counted in the stats).

Multi-turn: ``train(cfg, model=..., tokenizer=..., prompts=rows, env=MyEnv)`` (``align.envs``), or ``tools=[fn]``
for the built-in tool environment; ``reward`` is then optional.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from align.data import InputError
from align.run.config import CLI_PREFIXES, TrainConfig

log = logging.getLogger(__name__)

__all__ = ["CLI_PREFIXES", "TrainConfig", "main", "step_record", "train"]
SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}


def train(
    cfg: TrainConfig,
    *,
    model: str | None = None,
    tokenizer: Any = None,
    prompts: list | None = None,
    reward: Callable[..., float | None] | None = None,
    eval_prompts: list | None = None,
    env: type | None = None,
    tools: list | None = None,
    stop_flag: dict | None = None,
) -> dict:
    """Run GRPO; returns a summary dict. Resumes from the last committed checkpoint under ``cfg.out``.

    ``stop_flag`` (set by ``main``'s signal handlers: {"signal": signum}) makes the loop checkpoint after
    the current step and return early with ``summary["interrupted"] = signum``."""
    from align import dist, learner
    from align.advantages import compute_advantages
    from align.rollout.pipeline import Interrupted
    from align.run.build import open_run

    run = open_run(
        cfg,
        model=model,
        tokenizer=tokenizer,
        prompts=prompts,
        reward=reward,
        eval_prompts=eval_prompts,
        env=env,
        tools=tools,
        stop_flag=stop_flag,
    )
    with run:  # closes pipeline, client, scorer, logs and worker; drains the evaluator
        run.emit(run.baseline())  # the step-0 eval, once per run
        run.stop_flag["loop"] = True  # from here a signal stops after the current step (before: main raises)
        while run.step < cfg.steps:
            t0 = time.monotonic()
            run.policy.train()
            # 1-3. prompts -> rollouts -> rewards (align.rollout.pipeline: this thread, or K steps ahead)
            try:
                produced, async_stats = run.pipe.next(run.step + 1)
            except Interrupted:  # a signal while waiting for the producer (e.g. a reward stuck in a sleep)
                run.checkpointer.save(run.step, force=run.step > 0)  # unless committed already
                break
            groups = produced.groups
            scores = groups.tensors(cfg.group_size)  # (P, G) total, terms, lengths, truncated; NaN = unscorable
            run.check_rewards(groups, run.step + 1)
            # 4. advantages
            adv, valid, adv_stats = compute_advantages(
                scores.total, cfg.adv, lengths=scores.lengths, truncated=scores.truncated, max_tokens=cfg.max_tokens
            )
            # 5. loss / backward / optimizer step(s) (align.learner: fused logprobs, micro-batches, global normalisers)
            upd = learner.update(
                run.policy,
                run.ref_model,
                run.opt,
                cfg,
                run.place,
                run.prompt_ids(groups),
                groups.completions,
                adv,
                valid,
                run.teacher,
            )
            run.sched.step()
            run.step += 1
            # 6. weights to the rollout engine (every backend, every K; nothing to do for the native sampler at K = 0)
            sync_s = run.pipe.publish(run.step, run.policy)
            # 7. log
            rec = step_record(run.step, produced, scores, upd, adv_stats, async_stats, sync_s, cfg, run.sched)
            rec["step_time"] = time.monotonic() - t0
            run.log(rec, groups, scores, adv)
            run.nonfinite.add(upd, run.step)  # stops the run at --max-nonfinite-steps, before any checkpoint
            # 8. eval and checkpoint: each decides its own cadence
            is_final = run.step == cfg.steps
            run.emit(run.eval_step(run.step, is_final))
            dist.agree_on_signal(run.stop_flag)  # torchrun: a signal seen by any rank stops every rank after this step
            run.checkpointer.save(run.step, last_step=is_final, force=bool(run.stop_flag.get("signal")))
            if run.stop_flag.get("signal"):
                break
    run.export_final()  # --save-hf after the last step, plot.svg
    return run.summary()


def step_record(
    step: int,
    produced: Any,
    scores: Any,
    upd: Any,
    adv_stats: dict,
    async_stats: dict,
    sync_s: float,
    cfg: TrainConfig,
    sched: Any,
) -> dict:
    """The metrics record of one step (``metrics.jsonl``; the progress line shows a few keys)."""
    from align.envs.episodes import env_stats

    groups, total = produced.groups, scores.total
    finite = total[~total.isnan()]
    gen_tokens = sum(len(c.token_ids) for c in groups.completions)
    refill = {}
    if cfg.adv_refill:
        refill = {
            "refill_rounds": groups.rounds,
            "refill_prompts": groups.sampled_prompts - len(groups.idx),
            "signal_groups": groups.signal_groups,
        }
    return {
        "step": step,
        "reward_mean": float(finite.mean()) if finite.numel() else math.nan,
        "reward_std": float(finite.std()) if finite.numel() > 1 else 0.0,
        **upd.stats,
        **adv_stats,
        "unscorable": int(total.isnan().sum()),
        "reward_errors": len(groups.scores.errors),
        "reward_timeouts": groups.scores.timeouts,
        **{
            f"reward/{n}_mean": float(v[~v.isnan()].mean()) if (~v.isnan()).any() else math.nan
            for n, v in scores.terms.items()
        },
        **refill,
        **(env_stats(groups.completions) if hasattr(groups.completions[0], "turns") else {}),  # episodes
        "completion_len_mean": gen_tokens / len(groups.completions),
        "truncated_frac": float(scores.truncated.float().mean()),
        "tokens_per_s": gen_tokens / max(produced.seconds, 1e-9),  # generation + rewards where they ran, not the wait
        "rollout_time": produced.seconds,
        "sync_time": sync_s,
        "step_time": 0.0,  # set by the loop once the step is logged
        "lr": sched.get_last_lr()[0],
        "grad_norm": upd.grad_norm,
        "nonfinite_steps": upd.nonfinite,  # optimizer steps skipped (non-finite loss or grad norm)
        **async_stats,
    }


def print_summary(s: dict) -> None:
    acc = ""
    if s["eval_start"] is not None:
        acc = f"held-out pass@1 {s['eval_start']:.3f} -> {s['eval_end']:.3f} | "
    print(
        f"[align] done: {s['steps']} steps | {acc}wall {s['wall_s']:.0f}s | run dir {s['out']} "
        f"(config.json, metrics.jsonl, plot.svg, checkpoints/)",
        flush=True,
    )


def stop_on_signals(stop_flag: dict) -> dict:
    """SIGTERM / SIGINT handlers for a training loop: before the loop (``stop_flag["loop"]`` unset) a signal raises
    ``Interrupted``; in it, the loop finishes the step, checkpoints and returns; a second signal stops at once.
    Returns the previous handlers (restore them with ``signal.signal``)."""
    from align.rollout.pipeline import Interrupted

    def on_signal(signum, frame):
        if stop_flag.get("signal"):  # second signal: stop now
            raise KeyboardInterrupt
        stop_flag["signal"] = signum
        if not stop_flag.get("loop"):  # setup (warm start, data, templates, model load): nothing to save yet
            print(f"\n[align] got signal {signum} before the first step: exiting", flush=True)
            raise Interrupted(signum)
        print(f"\n[align] got signal {signum}: finishing this step, writing a checkpoint, then exiting", flush=True)

    return {s: signal.signal(s, on_signal) for s in SIGNAL_EXIT}


def main(argv: list[str] | None = None) -> int:
    from align.atomic import LockHeldError
    from align.learner import NonFiniteError
    from align.rollout.pipeline import Interrupted
    from align.run.checkpoint import CheckpointError
    from align.run.presets import parse

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse(TrainConfig, argv, CLI_PREFIXES, description=__doc__.split("\n\n")[0])
    stop_flag: dict = {}
    old = stop_on_signals(stop_flag)
    try:
        summary = train(cfg, stop_flag=stop_flag)
    except (
        InputError,
        CheckpointError,
        LockHeldError,
    ) as e:  # bad input; a checkpoint that cannot resume; --out in use
        print(f"align.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Interrupted as e:  # a signal during setup; the run's parts are closed (open_run, ``with run``)
        return SIGNAL_EXIT[e.signum]
    except NonFiniteError as e:  # --max-nonfinite-steps reached; the last checkpoint is intact
        print(f"align.train: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    from align.dist import is_main

    if is_main():  # torchrun: one summary line
        print_summary(summary)
    if summary["interrupted"]:
        return SIGNAL_EXIT[summary["interrupted"]]
    return 0


if __name__ == "__main__":
    sys.exit(main())
