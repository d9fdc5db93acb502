"""The evaluation part of a GRPO run: the held-out set (prompts, or an environment's episodes) and the evaluator
that scores it, in this process (blocking) or on snapshots (``align.eval``: an eval fleet, a ``CheckpointEvalFn``);
with K >= 1 on the shared rollout engine, eval epochs pinned to one version (``align.eval.pinned``).
``Evaluation.open`` builds it; ``step`` / ``baseline`` / ``drain`` are what the run calls.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from align import dist, lora
from align.run.policy import completion_text

log = logging.getLogger(__name__)


def rollout_params(cfg: Any, stops: list[int]) -> Any:
    """How a training step's prompts are sampled (G completions each, the run's sampling flags)."""
    from align.rollout.protocol import SamplingParams

    return SamplingParams(
        n=cfg.group_size,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.max_tokens,
        stop_token_ids=stops,
        min_p=cfg.min_p,
        repetition_penalty=cfg.repetition_penalty,
    )


def eval_params(cfg: Any, stops: list[int]) -> Any:
    """How held-out prompts are sampled (``align.train`` and ``align.sft``): --eval-n, --eval-temperature (else the
    run's), --eval-max-tokens (else --max-tokens), the run's top-p / top-k, stop ids and seed."""
    from align.rollout.protocol import SamplingParams

    return SamplingParams(
        n=cfg.eval.eval_n,
        temperature=cfg.temperature if cfg.eval.eval_temperature is None else cfg.eval.eval_temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.eval.eval_max_tokens or cfg.max_tokens,
        stop_token_ids=stops,
        seed=cfg.seed,
    )


def unscored(i: int, ids: list[int]) -> None:
    """The placeholder score of an episode set's rows (its episodes are scored by the environment)."""


class Evaluation:
    """The held-out set and its evaluator. ``blocking(step)`` scores the live policy in this process (prompts, or
    the sampler's episodes on the policy), ``episodes(client, sampling)`` runs the held-out episodes on any client
    (a fleet's, a pinned engine's), ``score`` / ``export`` are the evaluator's reward and snapshot writer."""

    def __init__(self, cfg: Any, task: Any, learner: Any, place: Any, stops: list[int]) -> None:
        self.cfg, self.task, self.learner, self.place, self.stops = cfg, task, learner, place, stops
        self.sampling = eval_params(cfg, stops)
        self.eval_set: Any = None
        self.evaluator: Any = None
        self.eval_cfg = cfg.eval
        self.weights: list = []  # torchrun: the eval step's weights, gathered to rank 0's CPU by every rank

    @classmethod
    def open(
        cls, cfg: Any, task: Any, learner: Any, place: Any, stops: list[int], fleet: Any, should_stop: Any
    ) -> Evaluation:
        """The held-out set (``task.eval_encoded``, or the sampler's episodes) and its evaluator (``make_evaluator``:
        blocking, or snapshots on ``fleet`` / a ``CheckpointEvalFn``); the in-process eval is off without held-out
        prompts."""
        from align.eval import EvalSet, make_evaluator
        from align.eval.evaluator import Evaluator

        self = cls(cfg, task, learner, place, stops)
        if task.eval_encoded:
            self.eval_set = EvalSet(task.eval_encoded, self.score, self.sampling, name=task.name)
        if task.sampler.evaluate is not None and task.task.eval_prompts:  # held-out episodes: the sampler runs them
            rows = [[0]] * len(task.task.eval_prompts)
            self.eval_set = EvalSet(rows, unscored, self.sampling, task.name, self.episodes)
        eval_cfg = cfg.eval
        if self.eval_set is None and not eval_cfg.uses_snapshots and eval_cfg.eval_interval > 0:
            log.info("no held-out prompts: in-process eval is off (pass eval_prompts=... or --eval-data to evaluate)")
            eval_cfg = replace(eval_cfg, eval_interval=0)
        self.eval_cfg = eval_cfg
        if dist.active() and not dist.is_main() and eval_cfg.uses_snapshots:  # torchrun: rank 0 alone dispatches
            self.evaluator = Evaluator(eval_cfg)
            return self
        self.evaluator = make_evaluator(
            eval_cfg,
            self.eval_set,
            export_fn=self.export,
            blocking_eval_fn=self.blocking if self.eval_set else None,
            should_stop=should_stop,
            reserved_gpus=[cfg.rollout_gpu],
            run_id=task.run_id,
            fleet=fleet,
        )
        return self

    def pin(self, pipe: Any) -> None:
        """K >= 1 on the shared rollout engine: eval epochs pinned to one version (``align.eval.pinned``)."""
        from align.eval.pinned import pinned_evaluator

        self.evaluator = pinned_evaluator(pipe, self.evaluator, self.eval_set, self.cfg)

    def episodes(self, client: Any, sampling: Any) -> tuple[dict, list]:
        """Held-out episodes on any client, scored."""
        from align.eval.metrics import score_episodes

        eps, scores = self.task.sampler.evaluate(client, sampling)
        n = len(self.task.task.eval_prompts)
        return score_episodes(eps, scores, n, sampling.n, self.task.pass_reward), eps

    def blocking(self, at_step: int) -> dict:
        """One eval point of the live policy in this process."""
        from align.eval.metrics import score_completions
        from align.rollout.client import NativeClient, ShardedNativeClient
        from align.rollout.native import generate

        policy, encoded, sampling = self.learner.policy, self.task.eval_encoded, self.sampling
        policy.eval()
        if self.eval_set.episodes is not None:
            return self.eval_set.episodes(NativeClient(policy), sampling)[0]
        with self.place.autocast():  # as the training rollouts (bf16-mixed: bf16 matmuls)
            if dist.active():  # torchrun: every rank samples its share (the same completions), all score them
                comps = ShardedNativeClient(policy).generate(encoded, sampling)
            else:
                comps = generate(policy, encoded, sampling)
        return score_completions(encoded, comps, self.eval_set.score, sampling.n)

    def score(self, i: int, ids: list[int]) -> Any:
        """Held-out prompt ``i``'s completion ``ids`` scored, with the reward that decides pass@k."""
        from align.eval.metrics import scored

        text = completion_text(self.task.task.tokenizer, self.stops, ids)
        return scored(*self.task.scorer.score([(self.task.task.eval_prompts[i], text)]).item(0), self.task.pass_reward)

    def export(self, path: str) -> None:
        """An eval point's snapshot. LoRA: the adapter (the fleet serves it on the base model); merged for a
        CheckpointEvalFn's own backend. torchrun: the weights rank 0 gathered (``step``)."""
        lora.save_policy(
            self.weights.pop() if dist.active() else self.learner.policy,
            path,
            merge=self.cfg.eval.eval_function_path is not None,
            copy_tokenizer_from=self.cfg.data.tokenizer or self.task.model_path,
        )

    def step(self, step: int, is_final: bool) -> list[dict]:
        """Due evals of ``step`` (the evaluator decides) and finished ones; torchrun gathers a snapshot's weights."""
        if dist.active() and self.eval_cfg.uses_snapshots and self.eval_cfg.is_due(step, is_final):
            self.weights[:] = [dist.full_model(self.learner.policy, to_main_cpu=True)]  # a collective: all ranks
        return self.evaluator.step(step, is_final) + self.evaluator.poll()

    def baseline_dir(self, resumed: bool) -> str:
        """The step-0 snapshot: the base model; in LoRA mode with an eval fleet the untrained adapter (written once,
        atomically, before step 1), so the fleet starts its engines with LoRA enabled for every later point."""
        cfg, model_path = self.cfg, self.task.model_path
        if not (cfg.lora.enabled and cfg.eval.eval_num_gpus > 0 and not cfg.eval.eval_function_path):
            return model_path
        step0 = self.task.out / "lora_step0_adapter"
        if not resumed and not (step0 / "adapter_config.json").exists():
            lora.save_policy(self.learner.policy, step0)
        return str(step0) if (step0 / "adapter_config.json").exists() else model_path

    def baseline(self, written: list[dict], resumed: bool) -> list[dict]:
        """The step-0 eval, once per run, through the evaluator's own path."""
        if self.eval_set is None:
            return []
        return self.evaluator.baseline(self.baseline_dir(resumed), written=written, resumed=resumed)

    def drain(self, after_error: BaseException | None = None) -> list[dict]:
        """Settle every pending point (``Evaluator.drain``) and return the last records."""
        return self.evaluator.drain(after_error=after_error) if self.evaluator is not None else []

    def drain_after(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """The run failed while opening (an ``ExitStack`` exit callback): the evaluator's backend is released."""
        self.drain(after_error=exc)
