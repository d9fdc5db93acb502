"""Eval epochs pinned to one policy version on the shared rollout engine (seed 002), for ``--max-async-steps``
K >= 1 without an eval fleet or ``CheckpointEvalFn``: ``PinnedEvaluator`` drives the eval lease of an
``align.rollout.pipeline.RolloutPipeline`` (queue, lease = the watcher's policy lock, drain -> cohort -> refill, release).
"""

from __future__ import annotations

import contextlib
from typing import Any

from align.rollout.pipeline import RolloutPipeline


class PinnedEvaluator:
    """The shared-engine eval posture with K >= 1 (seed 002): eval runs on the rollout engine, each due step pinned
    to exactly its weights version by the eval lease. Same calls as ``align.eval.Evaluator``."""

    posture = "pinned"

    def __init__(self, cfg: Any, pipe: RolloutPipeline, eval_set: Any, permits: int | None, timeout_s: float) -> None:
        from align.eval.metrics import score_completions

        if permits is not None and eval_set.episodes is None and eval_set.sampling.n > permits:
            raise ValueError(
                f"an eval group of --eval-n {eval_set.sampling.n} completions is larger than --max-inflight-requests "
                f"{permits}: the eval epoch could never dispatch its cohort and release its lease; lower --eval-n "
                "or raise --max-inflight-requests"
            )
        self.cfg, self.pipe, self.timeout_s = cfg, pipe, timeout_s
        prompts = [list(p) for p in eval_set.prompts]

        def eval_fn() -> Any:
            if eval_set.episodes is not None:  # held-out episodes: each turn a request on the engine, under the lease
                return lambda client: eval_set.episodes(client, eval_set.sampling)

            def score(comps: list) -> dict:
                m = score_completions(prompts, comps, eval_set.score, eval_set.sampling.n)
                return {k: v for k, v in m.items() if k not in ("eval/weight_version", "eval/mixed_version_ratio")}

            return prompts, eval_set.sampling, permits, score

        pipe.pin_eval(eval_fn, lambda step: cfg.is_due(step, step == pipe.last_step))

    def baseline(self, hf_dir: str, *, written: Any = (), resumed: bool = False) -> list[dict]:
        """Step 0 through the same epoch path, before the producer starts (a resumed run no longer has version 0)."""
        if self.cfg.eval_interval <= 0 or resumed or any(r.get("step") == 0 and "eval/step" in r for r in written):
            return []
        self.pipe.request_eval(0)
        self.pipe.wait_evals(self.timeout_s)
        return self.poll()

    def step(self, step: int, is_final: bool = False) -> list[dict]:
        return self.poll()  # due steps were queued by ``publish``, atomically with the version

    def poll(self) -> list[dict]:
        return self.pipe.take_eval_records()

    def drain(self, after_error: BaseException | None = None) -> list[dict]:
        if after_error is None:
            self.pipe.wait_evals(self.timeout_s)
            return self.poll()
        with contextlib.suppress(Exception):
            return self.poll()
        return []


def pinned_evaluator(pipe: RolloutPipeline, evaluator: Any, eval_set: Any, cfg: Any) -> Any:
    """``evaluator`` unless this run evaluates on the shared rollout engine with K >= 1 (no eval fleet, no
    ``CheckpointEvalFn``): then the ``PinnedEvaluator``."""
    if not pipe.is_async or getattr(evaluator, "posture", None) != "blocking" or eval_set is None:
        return evaluator
    return PinnedEvaluator(evaluator.cfg, pipe, eval_set, cfg.max_inflight_requests, cfg.rollout_timeout_s)
