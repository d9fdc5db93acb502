"""Eval configuration (the seed's flags) and the eval set. stdlib only.

``EvalConfig`` is the single source of truth for the eval flags; the training CLI generates
``--eval-interval``, ``--eval-hf-dir``, ... from its fields (kebab-case, help from ``metadata``).

Posture (seed ``000_...``): a dedicated fleet (``eval_num_gpus > 0``) or a ``CheckpointEvalFn``
(``eval_function_path``) selects *snapshot eval*: each eval point exports an HF snapshot to
``{eval_hf_dir}/step_{N}`` and the eval runs asynchronously. Neither set: the blocking in-process eval.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from align.options import flag
from align.rollout.protocol import SamplingParams

OVERFLOW_POLICIES = ("backpressure", "skip")


@dataclass
class EvalConfig:
    eval_interval: int = flag(0, "Evaluate every N optimizer steps and at the final step (0 = no eval).")
    eval_num_gpus: int = flag(
        0,
        "Size of the dedicated eval fleet: >0 runs eval on its own rollout workers (CPU workers on a "
        "machine without GPUs), synced only by loading exported snapshots, never by training weight sync; with "
        "the Ray rollout fleet, Ray actors in its placement group's appended bundles. 0 = no fleet.",
    )
    eval_num_gpus_per_engine: int = flag(1, "GPUs per eval engine (tensor-parallel size); must divide --eval-num-gpus.")
    eval_first_gpu: int | None = flag(
        None,
        "First GPU of the eval fleet (engine i uses the next --eval-num-gpus-per-engine GPUs); default: "
        "the last --eval-num-gpus GPUs, past the training GPUs. Ignored without GPUs (CPU workers).",
    )
    eval_hf_dir: str | None = flag(
        None,
        "Staging dir for per-eval HF snapshots at {eval_hf_dir}/step_{N} (tmpfs recommended). Required "
        "for snapshot eval (--eval-num-gpus or a CheckpointEvalFn); never the --save-hf dir.",
    )
    eval_max_in_flight: int = flag(2, "Max concurrently pending async evals.")
    eval_overflow_policy: str = flag(
        "backpressure",
        "When a point is due with --eval-max-in-flight pending: 'backpressure' waits for the oldest, "
        "'skip' drops the point and logs eval/skipped_busy. The final step is never dropped.",
    )
    eval_keep_snapshots: int = flag(2, "Settled snapshot dirs kept under --eval-hf-dir; older ones are deleted.")
    eval_function_path: str | None = flag(
        None,
        "A CheckpointEvalFn subclass, 'package.module:ClassName' or 'path/to/file.py:ClassName', that "
        "evaluates each snapshot on a backend you own. Mutually exclusive with --eval-num-gpus.",
    )
    ci_test: bool = flag(False, "CI mode: any skipped or crashed eval point fails the run.")
    eval_n: int = flag(1, "Samples per eval prompt (the n of pass@k / avg@k; replaces the eval set's n).")
    eval_temperature: float | None = flag(None, "Eval sampling temperature (default: the eval set's; 0 = greedy).")
    eval_max_tokens: int | None = flag(None, "Max new tokens per eval completion (default: the eval set's).")
    eval_pass_reward: str | None = flag(
        None,
        "The --reward whose value > 0 makes an eval completion correct for pass@k (avg@n stays the mean "
        "weighted total); 'total': the weighted sum > 0. Default: the one reward; required with several.",
    )
    eval_timeout_s: float = flag(
        600.0,
        "Timeout in seconds of one fleet operation (worker start, snapshot load, generate), or of one "
        "CheckpointEvalFn call (past it the point is eval/skipped_timeout and training goes on).",
    )

    def __post_init__(self) -> None:
        for name in ("eval_interval", "eval_num_gpus", "eval_keep_snapshots"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.eval_num_gpus_per_engine < 1:
            raise ValueError(f"--eval-num-gpus-per-engine must be >= 1, got {self.eval_num_gpus_per_engine}")
        if self.eval_first_gpu is not None and self.eval_first_gpu < 0:
            raise ValueError(f"--eval-first-gpu must be >= 0, got {self.eval_first_gpu}")
        if self.eval_num_gpus % self.eval_num_gpus_per_engine:
            raise ValueError(
                f"--eval-num-gpus-per-engine {self.eval_num_gpus_per_engine} must divide --eval-num-gpus "
                f"{self.eval_num_gpus}"
            )
        if self.eval_max_in_flight < 1:
            raise ValueError(f"--eval-max-in-flight must be >= 1, got {self.eval_max_in_flight}")
        if self.eval_overflow_policy not in OVERFLOW_POLICIES:
            raise ValueError(
                f"--eval-overflow-policy must be one of {OVERFLOW_POLICIES}, got {self.eval_overflow_policy!r}"
            )
        if self.eval_n < 1:
            raise ValueError(f"--eval-n must be >= 1, got {self.eval_n}")
        if self.eval_temperature is not None and self.eval_temperature < 0:
            raise ValueError(f"--eval-temperature must be >= 0 (0 = greedy), got {self.eval_temperature}")
        if self.eval_max_tokens is not None and self.eval_max_tokens < 1:
            raise ValueError(f"--eval-max-tokens must be >= 1, got {self.eval_max_tokens}")
        if not (math.isfinite(self.eval_timeout_s) and self.eval_timeout_s > 0):
            raise ValueError(f"--eval-timeout-s must be a finite number > 0, got {self.eval_timeout_s}")
        if self.eval_num_gpus > 0 and self.eval_function_path:
            raise ValueError(
                f"--eval-num-gpus {self.eval_num_gpus} and --eval-function-path {self.eval_function_path!r} are "
                "mutually exclusive: the fleet and a CheckpointEvalFn each own weight delivery; pick one"
            )
        if self.eval_hf_dir and self.eval_interval <= 0:
            raise ValueError(
                f"--eval-hf-dir {self.eval_hf_dir!r} requires --eval-interval N > 0 (got {self.eval_interval}): "
                "without eval points nothing is ever staged there; set --eval-interval or drop --eval-hf-dir"
            )
        if self.uses_snapshots:
            if not self.eval_hf_dir:
                raise ValueError(
                    "snapshot eval (--eval-num-gpus > 0 or --eval-function-path) requires --eval-hf-dir, the staging "
                    "dir for per-eval snapshots (tmpfs recommended)"
                )
            if self.eval_interval <= 0:
                raise ValueError("snapshot eval (--eval-num-gpus > 0 or --eval-function-path) requires --eval-interval")

    @property
    def uses_snapshots(self) -> bool:
        """Snapshot eval (fleet or CheckpointEvalFn); False = the blocking in-process eval."""
        return self.eval_num_gpus > 0 or bool(self.eval_function_path)

    @property
    def num_engines(self) -> int:
        return self.eval_num_gpus // self.eval_num_gpus_per_engine

    def check_save_hf(self, save_hf: str | None) -> None:
        """Raise ValueError if the eval staging dir would reuse or overlap the ``--save-hf`` checkpoints.

        The dispatcher deletes settled snapshots under ``eval_hf_dir``; a ``--save-hf`` checkpoint is never an
        eval snapshot, so the two trees must be disjoint. ``--save-hf`` is one directory, written once at the final
        step: a template such as ``.../step_{step}`` is refused (train never fills it in).
        """
        if save_hf and ("{" in save_hf or "}" in save_hf):
            raise ValueError(
                f"--save-hf {save_hf!r} is a template, but the final model is exported once, to one directory, and "
                "nothing fills in '{...}'; pass a plain directory (per-step snapshots: --eval-hf-dir, checkpoints/)"
            )
        if not save_hf or not self.eval_hf_dir:
            return
        a = os.path.realpath(self.eval_hf_dir)
        b = os.path.realpath(save_hf)
        if a == b or _is_under(a, b) or _is_under(b, a):
            raise ValueError(
                f"--eval-hf-dir {self.eval_hf_dir!r} overlaps --save-hf {save_hf!r}: eval snapshots are staged and "
                "garbage-collected there, and --save-hf checkpoints are never reused as eval snapshots; use a "
                "separate dir (e.g. /dev/shm/eval_hf)"
            )

    def sampling_for(self, eval_set: EvalSet) -> SamplingParams:
        """The eval set's sampling params with ``eval_n`` / ``eval_temperature`` / ``eval_max_tokens`` applied."""
        changes: dict = {"n": self.eval_n}
        if self.eval_temperature is not None:
            changes["temperature"] = self.eval_temperature
        if self.eval_max_tokens is not None:
            changes["max_tokens"] = self.eval_max_tokens
        return dataclasses.replace(eval_set.sampling, **changes)

    def is_due(self, step: int, is_final: bool) -> bool:
        """Eval points: every ``eval_interval`` optimizer steps (1-based count) and always the final step."""
        return self.eval_interval > 0 and (is_final or step % self.eval_interval == 0)


def _is_under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


@dataclass
class EvalSet:
    """What to evaluate: prompts (token ids), a reward per completion, how to sample.

    ``score(prompt_index, completion_token_ids) -> Scored | float | None``: the completion's reward and whether it
    is *correct* (``align.eval.metrics.Scored``), or just the reward, correct when > 0; ``None`` (unscorable)
    counts as reward 0, incorrect.

    ``episodes(client, sampling) -> (metrics, completions)``: held-out *episodes* (an environment task: ``--env``,
    ``--tools``): the turn loop is align's, so the set is run on the backend's ``client`` (``generate(prompts,
    params)``: a pinned fleet's, or the rollout engine's under the eval lease) instead of generating ``prompts`` once;
    ``prompts`` and ``score`` are then placeholders (one per row, for the count).
    """

    prompts: list[list[int]]
    score: Callable[[int, list[int]], Any]  # -> Scored | float | None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    name: str = "eval"
    episodes: Callable[[Any, SamplingParams], tuple[dict, list]] | None = None

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError(f"EvalSet {self.name!r} has no prompts; an eval point could never produce a metric")
        if any(not p for p in self.prompts):
            raise ValueError(f"EvalSet {self.name!r} has an empty prompt; every prompt needs at least one token")
