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
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from align.run.cli import SIGNAL_EXIT, run_main, stop_on_signals
from align.run.config import CLI_PREFIXES, TrainConfig

log = logging.getLogger(__name__)

__all__ = ["CLI_PREFIXES", "SIGNAL_EXIT", "TrainConfig", "main", "step_record", "stop_on_signals", "train"]


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
    agent: Callable[..., Any] | None = None,
) -> dict:
    """Run GRPO; returns a summary dict. Resumes from the last committed checkpoint under ``cfg.out``.

    ``stop_flag`` (set by ``main``'s signal handlers: {"signal": signum}) makes the loop checkpoint after
    the current step and return early with ``summary["interrupted"] = signum``."""
    from align import dist
    from align.advantages import compute_advantages
    from align.rollout.pipeline import Interrupted
    from align.run.build import Given, open_run

    env = env if agent is None else _agent_env(agent)  # an agent program: the gateway's environment row
    run = open_run(cfg, Given(model, tokenizer, prompts, reward, eval_prompts, env, tools), stop_flag)
    with run:  # closes the pipeline, rollout backend, scorer and logs; drains the evaluator
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
            scores = run.scores(groups)  # (P, G) total, terms, lengths, truncated; NaN = unscorable
            # 4. advantages
            adv, valid, adv_stats = compute_advantages(
                scores.total, cfg.adv, lengths=scores.lengths, truncated=scores.truncated, max_tokens=cfg.max_tokens
            )
            # 5. loss / backward / optimizer step(s) (align.learner: fused logprobs, micro-batches, global normalisers)
            upd = run.learner.update(run.batch(groups, adv, valid))
            run.step += 1
            # 6. weights to the rollout engine (every backend, every K; nothing to do for the native sampler at K = 0)
            sync_s = run.pipe.publish(run.step, run.policy)
            # 7. log (then stop at --max-nonfinite-steps, before any checkpoint)
            rec = step_record(run.step, produced, scores, upd, adv_stats, async_stats, sync_s, cfg, run.sched)
            rec["step_time"] = time.monotonic() - t0
            run.log(rec, groups, scores, adv, upd)
            # 8. eval and checkpoint: each decides its own cadence
            is_final = run.step == cfg.steps
            run.emit(run.eval_step(run.step, is_final))
            dist.agree_on_signal(run.stop_flag)  # torchrun: a signal seen by any rank stops every rank after this step
            run.checkpointer.save(run.step, last_step=is_final, force=bool(run.stop_flag.get("signal")))
            if run.stop_flag.get("signal"):
                break
    run.export_final()  # --save-hf after the last step, plot.svg
    return run.summary()


def _agent_env(agent: Callable[..., Any]) -> type:
    from align.gateway.agents import bind

    return bind(agent)


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
    # policy tokens only: an episode's environment tokens (mask False) are context, counted under env/
    policy_tokens = sum(sum(c.mask) if getattr(c, "mask", None) else len(c.token_ids) for c in groups.completions)
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
        **({"rollout/evicted_groups": len(groups.evicted)} if cfg.group_timeout_s else {}),
        **(env_stats(groups.completions) if hasattr(groups.completions[0], "turns") else {}),  # episodes
        "completion_len_mean": policy_tokens / len(groups.completions),
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


def main(argv: list[str] | None = None) -> int:
    from align.run.presets import parse

    description = __doc__.split("\n\n")[0]
    return run_main("align.train", partial(parse, TrainConfig, argv, CLI_PREFIXES, description), train, print_summary)


if __name__ == "__main__":
    sys.exit(main())
