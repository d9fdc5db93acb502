"""A run's one sampling seam: ``sample(idx, round_) -> completions`` for the rows ``idx`` of step ``t`` (refill round
``round_``), behind ``align.rollout.groups.collect_groups``. A single-turn task is the degenerate episode (one policy
turn, no environment: ``Turns``); an environment task runs episodes (``Episodes``: the class of ``--env NAME |
file.py:Class``, ``--task multiturn`` or ``--tools``, its lifecycle hooks (``align.envs``), the turn renderer, the
held-out episodes). Both draw with one ``step_seed``; the run wing names no environment.

Life: ``open_sampler(cfg, task, scorer)`` before the model loads (an environment's ``open`` hook: a verifier pool);
``start(...)`` once the model, the data cursor and the sampling params exist; ``collect(t, client, stop)`` per step;
``close()`` with the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from align.data import InputError

log = logging.getLogger(__name__)


def step_seed(seed: int, t: int, round_: int) -> int:
    """The sampling seed of step ``t``'s refill round ``round_``: it depends only on (seed, step, round), so a resumed
    run replays a step exactly."""
    return seed * 1_000_003 + t - 1 + round_ * 100_000_007


class Rows:
    """Which rows a step samples: the data cursor's (an environment's ``draws`` hook may replace it)."""

    def __init__(self, rows: list[dict], cursor: Any) -> None:
        self.rows, self.cursor = rows, cursor

    def begin(self, t: int) -> None:
        pass

    def next_prompts(self, k: int) -> list[int]:
        return self.cursor.next_prompts(k)

    def row(self, i: int) -> dict:
        return self.rows[i]

    def add(self, groups: Any, t: int) -> None:
        pass


class Turns:
    """A single-turn task: each sample one completion of the row's prompt ids, scored by ``--reward``."""

    terms: tuple[str, ...] = ()  # reward terms the sampler gives itself (an environment's "env")

    def __init__(self, cfg: Any, task: Any) -> None:
        self.cfg, self.task = cfg, task
        self.scorer: Any = None  # the run's --reward scorer (None: --distill-only without rewards)
        self.rows: Any = None
        self.carry: Any = None  # --partial-rollouts: the carried groups (align.rollout.partial.Carry)

    def encode(self) -> tuple[list[list[int]], list[list[int]]]:
        """The prompt ids of the training rows and the held-out rows."""
        t = self.task
        return t.encoded or tuple([t.tokenizer.encode(r["prompt"]) for r in p] for p in (t.prompts, t.eval_prompts))

    def start(
        self, *, params: Any, cursor: Any, encoded: list, decode: Callable, context: int, autocast: Callable
    ) -> None:
        """What sampling needs once the model exists: its params, the data cursor, the ids, ``decode(ids) -> text``
        (a trailing stop token dropped), the model's context and the trainer's autocast."""
        self.params, self.encoded, self.decode, self.context, self.autocast = params, encoded, decode, context, autocast
        self.rows = self.open_rows(self.task.prompts, cursor)

    def open_rows(self, rows: list[dict], cursor: Any) -> Any:
        return Rows(rows, cursor)

    def open_carry(self, carried: list | None) -> Any:
        """``--partial-rollouts``: the run's carried groups (``carried``: a checkpoint's), drawn from in ``collect``."""
        from align.rollout.partial import Carry

        cfg = self.cfg
        self.carry = Carry(
            cfg.group_size,
            cfg.max_token_staleness,
            cfg.stale_policy,
            carried,
            cfg.partial_pool_factor,
            cfg.partial_prefill,
            cfg.partial_cut,
        )
        return self.carry

    def carried_prompt(self, i: int) -> Any:
        """What ``Carry.draw`` reads of row ``i``: its prompt ids (an episode's: the row itself)."""
        return self.encoded[i]

    def prompt_ids(self, idx: list[int]) -> list[list[int]]:
        """The prompt ids of a step's groups, for the learner."""
        return [self.encoded[i] for i in idx]

    def sample(self, client: Any, t: int, idx: list[int], params: Any) -> list:
        from align.rollout.engines import generate_groups

        prompts = [self.encoded[i] for i in idx]
        if self.cfg.group_timeout_s > 0 and not _native(client):  # a spool worker: each group its own request
            from align.rollout.deadlines import generate_by_group

            return generate_by_group(client, prompts, params, self.cfg.group_timeout_s)
        return generate_groups(client, prompts, params, self.cfg.max_inflight_requests)

    def text(self, c: Any) -> str:
        return self.decode(c.token_ids)

    def score(self, items: list, comps: list, stop: Any) -> Any:
        from align.rewards import Scores

        if self.cfg.distill.distill_only:  # no reward function runs; every total is 0 (the advantage is exactly 0)
            return Scores([0.0] * len(items), {})
        return self.scorer.score(items, stop, [c.token_ids for c in comps])

    @property
    def names(self) -> list[str]:
        if self.cfg.distill.distill_only:
            return []
        return [*self.terms, *(self.scorer.names if self.scorer else [])]

    def collect(self, t: int, client: Any, stop: Any = None) -> Any:
        """Steps 1-3 for step ``t``: rows -> G samples each (from ``client``) -> scores, as ``Groups`` (``--adv-refill``
        samples more rows until enough groups have signal). ``stop`` (K = 0 in one process: a signal) cuts the
        rewards."""
        from align.rollout.groups import collect_groups

        cfg, rows = self.cfg, self.rows
        rows.begin(t)

        def sample(idx: list[int], round_: int) -> list:
            params = replace(self.params, seed=step_seed(cfg.seed, t, round_))
            with self.autocast():  # the sampler computes like the trainer (bf16-mixed: bf16 matmuls)
                return self.sample(client, t, idx, params)

        draw, carry, before = None, self.carry, 0
        if carry is not None:  # --partial-rollouts: carried + fresh groups, the rest cut (align.rollout.partial)
            before = carry.dropped

            def draw(need: int, round_: int) -> tuple[list[int], list]:
                params = replace(self.params, seed=step_seed(cfg.seed, t, round_))
                with self.autocast():
                    return carry.draw(t, need, rows.next_prompts, self.carried_prompt, params, client)

        groups = collect_groups(
            cfg.prompts_per_step,
            rows.next_prompts,
            sample,
            self.text,
            rows.row,
            lambda items, comps: self.score(items, comps, stop),
            self.names,
            cfg.adv_refill,
            cfg.max_refill_rounds,
            cfg.group_timeout_s,
            cfg.evict_policy,
            draw,
        )
        if carry is not None:
            carry.mask_stale(t, groups)
            groups.dropped_stale = carry.dropped - before
        rows.add(groups, t)
        return groups

    def metrics(self, completions: list) -> dict:
        return {}

    evaluate = None  # held-out rows are scored by the eval wing on their prompt ids

    def close(self) -> None:
        pass


class Episodes(Turns):
    """An environment task: each sample one episode of the row (``align.envs.episodes``), scored by the environment's
    reward (term ``env``) plus ``--reward`` on the final assistant message."""

    terms = ("env",)

    def __init__(self, cfg: Any, task: Any) -> None:
        from align.chat import TurnRenderer
        from align.envs.runner import EnvRunner

        super().__init__(cfg, task)
        if cfg.partial_rollouts:
            from align import dist
            from align.rollout.backends import BACKENDS

            carries = getattr(BACKENDS[cfg.rollout], "carries_episodes", False)
            why = None if carries else f"--rollout {cfg.rollout} (episodes run one thread each there)"
            why = why or ("torchrun" if dist.active() else None)
            keep = cfg.partial_prefill == "keep"  # a carried episode (a turn cut inside too) is re-prefilled
            why = why or (
                "--partial-prefill keep (a carried episode is re-prefilled under the new weights)" if keep else None
            )
            why = why or (f"--group-timeout-s {cfg.group_timeout_s:g}" if cfg.group_timeout_s > 0 else None)
            why = why or ("--partial-cut publish" if cfg.partial_cut == "publish" else None)
            own = getattr(task.env, "run_episodes", None) is not None  # --agent: the gateway runs the turns
            why = why or ("an environment that runs its own episodes (--agent, --task agent)" if own else None)
            if why:
                raise InputError(
                    f"--partial-rollouts carries an environment's episodes on the native sampler in one process, "
                    f"without --group-timeout-s (align.envs.partial); not with {why}: drop one of the two"
                )
        if cfg.eval.eval_function_path:  # the function owns generation on its own backend; the turn loop is here
            raise InputError(
                f"--eval-function-path {cfg.eval.eval_function_path!r} evaluates a snapshot on your own "
                "backend, but an episode's turns (the environment, the chat-template suffixes, token-in/"
                "token-out) run in align's loop, which a CheckpointEvalFn cannot drive: drop "
                "--eval-function-path (held-out episodes are then evaluated in this process on the live "
                "policy) or run the environment inside your function on plain --train-data rows"
            )
        cls, self.opened = task.env, None
        if callable(getattr(cls, "open", None)):  # the environment's shared state: a verifier pool
            cls = self.opened = cls.open(cfg, task.tokenizer)
        # an environment that bounds its own steps (--env lean: the verifier's timeout) gets no --env-timeout-s
        timeout_s = 0.0 if getattr(cls, "own_timeout", False) else cfg.envs.env_timeout_s
        self.envs: Any = None
        try:
            self.envs = EnvRunner(task.env_spec, cls, cfg.envs.env_workers, timeout_s)
            self.renderer = TurnRenderer(task.tokenizer, tools=getattr(cls, "tools", None))
        except BaseException:
            self.close()
            raise
        self.runner: Any = None
        self.warned = False

    def encode(self) -> tuple[list[list[int]], list[list[int]]]:
        """No prompt ids: an episode's first prompt is its environment's ``reset()``."""
        return [[] for _ in self.task.prompts], []

    def open_rows(self, rows: list[dict], cursor: Any) -> Any:
        draws = getattr(self.envs.cls, "draws", None)
        own = draws(rows, cursor) if draws is not None else None
        if own is not None and self.cfg.partial_rollouts:  # its row indices are a step's own (a correction queue)
            raise InputError(
                f"--partial-rollouts carries episodes across steps by row, but {self.envs.cls.__name__} draws its own "
                "rows each step (e.g. --lean-correction-fraction): drop one of the two"
            )
        return own or Rows(rows, cursor)

    def open_carry(self, carried: list | None) -> Any:
        from align.envs.partial import EpisodeCarry

        cfg = self.cfg
        self.carry = EpisodeCarry(
            lambda: self.runner,
            cfg.group_size,
            cfg.max_token_staleness,
            cfg.stale_policy,
            carried,
            cfg.partial_pool_factor,
        )
        return self.carry

    def carried_prompt(self, i: int) -> Any:
        return self.rows.row(i)

    def start(self, **kw: Any) -> None:
        from align.envs.episodes import EpisodeRunner

        super().start(**kw)
        self.runner = EpisodeRunner(
            self.envs, self.renderer, self.decode, self.cfg.envs, self.cfg.max_tokens, self.context
        )

    def prompt_ids(self, idx: list[int]) -> list[list[int]]:
        return [[] for _ in idx]  # an episode carries its own first prompt (a correction row has no index in rows)

    def sample(self, client: Any, t: int, idx: list[int], params: Any) -> list:
        from align.rollout.deadlines import Sampled

        T = self.cfg.group_timeout_s
        eps = self.episodes(client, [self.rows.row(i) for i in idx], self.cfg.group_size, params, T)
        failed = [e for e in eps if e.error is not None]
        if len(failed) == len(eps):
            raise RuntimeError(
                f"every episode of step {t} failed in its environment; the first error:\n{failed[0].error}"
            )
        evicted = {}  # --group-timeout-s: the groups with an episode past the deadline, and the first one's why
        for e in eps:
            if e.evicted and e.prompt_index not in evicted:
                n = sum(x.evicted is not None for x in eps if x.prompt_index == e.prompt_index)
                evicted[e.prompt_index] = (
                    f"environment episodes past --group-timeout-s {T:g} ({n} episode(s)): {e.evicted}"
                )
        return Sampled(eps, evicted)

    def episodes(self, client: Any, rows: list[dict], G: int, params: Any, timeout_s: float = 0.0) -> list:
        own = getattr(self.envs.cls, "run_episodes", None)  # a source that runs its own turns (--agent: the gateway)
        eps = own(self, client, rows, G, params) if own else self.runner.run(client, rows, G, params, timeout_s)
        self.compare_once(eps)
        return eps

    def text(self, e: Any) -> str:
        return e.text

    def score(self, items: list, eps: list, stop: Any) -> Any:
        from align.envs.episodes import episode_scores

        return episode_scores(eps, items, self.scorer, stop)

    @property
    def names(self) -> list[str]:
        return [*self.terms, *(self.scorer.names if self.scorer else [])]

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

    def metrics(self, episodes: list) -> dict:
        """The environment's own per-step metrics (its ``metrics(episodes)`` hook: --env lean's ``lean/*``)."""
        fn = getattr(self.envs.cls, "metrics", None)
        return fn(episodes) if fn is not None else {}

    def evaluate(self, client: Any, sampling: Any) -> tuple[list, Any]:
        """The held-out rows' episodes (``sampling.n`` per row) on ``client`` and their ``Scores``: the live policy,
        a pinned fleet's engine (snapshot eval) or the rollout engine under the eval lease (pinned eval). They never
        reach the ``draws`` hook (a correction queue)."""
        from align.envs.episodes import episode_scores

        rows = self.task.eval_prompts
        with self.autocast():
            eps = self.episodes(client, rows, sampling.n, replace(sampling, n=1))
        return eps, episode_scores(eps, [(rows[e.prompt_index], e.text) for e in eps], self.scorer)

    def _close_env(self) -> None:
        if self.opened is not None and callable(getattr(self.opened, "close", None)):
            self.opened.close()
        self.opened = None

    def close(self) -> None:
        try:
            if self.carry is not None and self.envs is not None:
                self.carry.close()
            if self.envs is not None:
                self.envs.close()
        finally:
            self._close_env()


def check_env(cls: type, cfg: Any, located: list[tuple[str, dict]]) -> None:
    """Before the model loads: the environment's ``check_rows`` hook on every ``(where, row)``, and ``--env-workers``
    refused for a class with ``open`` (its shared state lives in this process; a worker would load it unopened)."""
    check_rows = getattr(cls, "check_rows", None)
    if check_rows is not None:
        check_rows(located)
    if cfg.envs.env_workers and callable(getattr(cls, "open", None)):
        raise InputError(
            f"the environment {cls.__name__} runs in this process (its open() starts what every episode shares, "
            f"e.g. --env lean's pool of Lean processes, --lean-workers); --env-workers {cfg.envs.env_workers} does "
            "not apply: drop it (or pass --env-workers 0)"
        )


def _native(client: Any) -> bool:
    from align.envs.episodes import _native_model

    return _native_model(client)[0] is not None


def open_sampler(cfg: Any, task: Any) -> Turns:
    """The run's sampler: ``Episodes`` for a task with an environment class, else ``Turns``."""
    return Turns(cfg, task) if task.env is None else Episodes(cfg, task)
