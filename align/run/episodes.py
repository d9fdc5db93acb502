"""The multi-turn stage of a run (``--env``, ``--tools``, ``--task multiturn``): the environment runner and the turn
renderer opened with the run, each step's episodes collected and scored as ``Groups``, and the in-process eval of
held-out episodes (pass@k over the same scores). The episode mechanics are ``align.envs.episodes``."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

from align.data import InputError
from align.envs.episodes import EpisodeRunner, episode_scores

log = logging.getLogger(__name__)


class RunEpisodes:
    """A run's episodes: ``collect(t, client, run)`` is steps 1-3 of the loop for an environment task."""

    def __init__(self, run: Any) -> None:
        from align.chat import TurnRenderer
        from align.envs.runner import EnvRunner

        cfg, task = run.cfg, run.task
        self.cfg = cfg
        self.verifier = self.queue = None  # --env lean: the verifier pool this run started; the correction queue
        if is_lean(task.env):
            self._open_lean(run)
        # --env lean: each proof is bounded by the verifier itself (--lean-timeout-s, --lean-retries), not the env call
        timeout_s = 0.0 if is_lean(task.env) else cfg.envs.env_timeout_s
        self.envs = EnvRunner(task.env_spec, task.env, cfg.envs.env_workers, timeout_s)
        self.renderer = TurnRenderer(task.tokenizer, tools=getattr(task.env, "tools", None))
        self.runner: EpisodeRunner | None = None  # made once the model's context is known (_open_policy)
        self.warned = False

    def _open_lean(self, run: Any) -> None:
        """--env lean: start the verifier pool (unless the class came bound to one), bind the environment class to it;
        with --lean-correction-fraction the correction queue over the rows and the data cursor (made later)."""
        cfg, task = run.cfg, run.task
        verifier = task.env.verifier
        if verifier is None:
            from align.lean.verify import LeanVerifier

            verifier = self.verifier = LeanVerifier(cfg.lean)  # a REPL that cannot start fails here, before the model
        task.env = task.env.bind(verifier, cfg.lean_corrections.lean_error_tokens, task.tokenizer)
        self.lean_cfg = cfg.lean_corrections

    def queue_for(self, run: Any) -> Any:
        """The correction queue (None without --lean-correction-fraction), once the data cursor exists."""
        if self.queue is None and is_lean(run.task.env) and self.lean_cfg.lean_correction_fraction > 0:
            from align.lean.corrections import CorrectionQueue

            self.queue = CorrectionQueue(self.lean_cfg, run.task.prompts, run.cursor)
        return self.queue

    def metrics(self, episodes: list) -> dict:
        """The environment's own per-step metrics (a class may define ``metrics(episodes)``: --env lean does)."""
        fn = getattr(self.envs.cls, "metrics", None)
        return fn(episodes) if fn is not None else {}

    def runner_for(self, run: Any) -> EpisodeRunner:
        if self.runner is None:
            self.runner = EpisodeRunner(
                self.envs,
                self.renderer,
                run.completion_text,
                self.cfg.envs,
                self.cfg.max_tokens,
                run.mcfg.max_position_embeddings,
            )
        return self.runner

    def episodes(self, run: Any, client: Any, rows: list[dict], G: int, params: Any) -> list:
        eps = self.runner_for(run).run(client, rows, G, params)
        self.compare_once(eps)
        return eps

    def compare_once(self, eps: list) -> None:
        """The token-in/token-out comparator, once per run on a multi-turn chat episode: the ids trained on vs the
        whole conversation rendered at once (templates that are not append-only differ: reported, not fatal)."""
        if self.warned:
            return
        for e in eps:
            if len(e.turns) > 1 and e.error is None and e.chat and self.renderer.template is not None:
                diff = self.renderer.check_append_only(e.messages, e.prompt_ids + e.token_ids)
                self.warned = True
                if diff:
                    log.warning(
                        "the chat template is not append-only: rendering the whole conversation at once "
                        "gives other ids than the turns as sampled (%s); training stays on the sampled "
                        "tokens",
                        diff,
                    )
                return

    def collect(self, t: int, client: Any, run: Any) -> Any:
        """Steps 1-3 for step ``t``: rows -> G episodes each -> scores (environment reward + --reward functions),
        through the same ``collect_groups`` as single-turn groups (so ``--adv-refill`` works on episodes too)."""
        from align import dist
        from align.rollout.groups import collect_groups

        cfg, queue = self.cfg, self.queue_for(run)
        row, next_prompts = (
            (queue.row, queue.next_prompts) if queue else (run.task.prompts.__getitem__, run.cursor.next_prompts)
        )
        if queue:
            queue.begin(t)

        def sample(idx: list[int], round_: int) -> list:
            params = replace(run.params, seed=cfg.seed * 1_000_003 + t - 1 + round_ * 100_000_007)
            with run.place.autocast():
                eps = self.episodes(run, client, [row(i) for i in idx], cfg.group_size, params)
            failed = [e for e in eps if e.error is not None]
            if len(failed) == len(eps):
                raise RuntimeError(
                    f"every episode of step {t} failed in its environment; the first error:\n{failed[0].error}"
                )
            return eps

        stop = None if run.pipe.is_async or dist.active() else run.pipe.should_stop  # K = 0: a signal cuts the rewards
        names = ["env", *(run.scorer.names if run.scorer else [])]
        groups = collect_groups(
            cfg.prompts_per_step,
            next_prompts,
            sample,
            lambda e: e.text,
            row,
            lambda items, eps: episode_scores(eps, items, run.scorer, stop),
            names,
            cfg.adv_refill,
            cfg.max_refill_rounds,
        )
        if queue:
            queue.add(groups, t)
        return groups

    def evaluate(self, run: Any, sampling: Any, client: Any = None) -> tuple[dict, list]:
        """pass@k of the held-out rows' episodes and the episodes, on ``client``: the live policy in this process
        (None: the blocking eval), a pinned fleet's (snapshot eval) or the rollout engine's under the eval lease
        (pinned eval). The rows' episodes never enter the correction queue."""
        from align.eval.metrics import score_completions, scored
        from align.rollout.client import NativeClient

        rows = run.task.eval_prompts
        client = NativeClient(run.policy) if client is None else client
        with run.place.autocast():
            eps = self.episodes(run, client, rows, sampling.n, replace(sampling, n=1))
        s = episode_scores(eps, [(rows[e.prompt_index], e.text) for e in eps], run.scorer)
        results = iter([scored(*s.item(j), run.pass_reward) for j in range(len(eps))])
        metrics = score_completions([[0]] * len(rows), eps, lambda i, ids: next(results), sampling.n)
        metrics["eval/first_turn_pass@1"] = _first_turn_success(eps)
        return metrics, eps

    def close(self) -> None:
        try:
            self.envs.close()
        finally:
            if self.verifier is not None:
                self.verifier.close()


def is_lean(env: Any) -> bool:
    """The built-in Lean environment (``--env lean``) or a class derived from it."""
    from align.lean.env import LeanEnv

    return isinstance(env, type) and issubclass(env, LeanEnv)


def _first_turn_success(eps: list) -> float:
    """The share of episodes whose first turn already earned a positive reward."""
    ok = [bool(e.turns) and (e.turns[0].get("reward") or 0) > 0 for e in eps]
    return sum(ok) / max(len(ok), 1) if ok else math.nan


def open_episodes(run: Any) -> None:
    """The run's ``RunEpisodes`` (``run.episodes``, closed with the run as ``run.envs``); refuses, before the model
    loads, the one eval backend that cannot run episodes."""
    cfg = run.cfg
    if cfg.eval.eval_function_path:  # the function owns generation on its own backend; the turn loop is here
        raise InputError(
            f"--eval-function-path {cfg.eval.eval_function_path!r} evaluates a snapshot on your own "
            "backend, but an episode's turns (the environment, the chat-template suffixes, token-in/"
            "token-out) run in align's loop, which a CheckpointEvalFn cannot drive: drop "
            "--eval-function-path (held-out episodes are then evaluated in this process on the live "
            "policy) or run the environment inside your function on plain --train-data rows"
        )
    run.episodes = run.envs = RunEpisodes(run)
