"""Eval metrics: pass@1, unbiased pass@k and avg@k over n samples per prompt. stdlib only.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with n samples of
which c are correct, the unbiased estimate of "at least one of k draws is correct" is
``1 - C(n - c, k) / C(n, k)``, averaged over prompts. avg@k is the mean reward over the k = n samples.

``EvalSet.score`` returns a ``Scored`` (reward, correct) or a plain reward (correct when > 0). The training
loop's scores are ``scored``: avg@n is the mean *total* (weighted sum of every ``--reward``), while pass@k
counts a completion correct when the one reward named by ``--eval-pass-reward`` is > 0, so a shaping term (a
format reward, a length bonus) never inflates pass@k. An unscorable (``None`` / NaN) completion is reward 0,
incorrect.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from align.data import InputError
from align.rollout.protocol import Completion, SamplingParams

log = logging.getLogger(__name__)

TOTAL = "total"  # --eval-pass-reward total: correct when the weighted sum of the rewards is > 0


def pass_reward_for(names: list[str], choice: str | None) -> str:
    """The reward whose value > 0 makes an eval completion correct (``--eval-pass-reward``): ``choice`` (a reward
    name, or ``total``); with one reward the default is that reward, with several the flag is required."""
    listed = ", ".join(names)
    if choice is None:
        if len(names) == 1:
            return names[0]
        raise InputError(
            f"{len(names)} rewards are configured ({listed}): name the one whose value > 0 means a correct answer "
            f"for the eval's pass@k with --eval-pass-reward NAME (e.g. --eval-pass-reward {names[0]}), or "
            f"--eval-pass-reward {TOTAL} to count the weighted sum > 0 (e.g. per-task rewards that abstain)"
        )
    if choice == TOTAL:
        if TOTAL in names:
            raise InputError(f"--eval-pass-reward {TOTAL} is ambiguous: a reward is named {TOTAL!r}; rename it")
        return TOTAL
    if choice not in names:
        raise InputError(f"--eval-pass-reward {choice!r} names no reward; choose one of {listed} (or {TOTAL})")
    return choice


class Scored(NamedTuple):
    """One eval completion's score: ``reward`` (the total, for avg@n; None = unscorable) and ``correct`` (pass@k)."""

    reward: float | None
    correct: bool


def scored(total: float | None, terms: Mapping[str, float | None], pass_reward: str) -> Scored:
    """A ``Scored`` from one completion's reward total and per-reward terms (None / NaN: unscorable, abstained)."""
    reward = total if total is not None and math.isfinite(total) else None
    v = reward if pass_reward == TOTAL else terms[pass_reward]
    return Scored(reward, v is not None and math.isfinite(v) and v > 0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with ``c`` correct out of ``n`` samples (``1 <= k <= n``)."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """The k reported for n samples: 1, powers of two below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def score_completions(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    score: Callable[[int, list[int]], Scored | float | None],
    n: int,
) -> dict[str, float]:
    """``eval/pass@k`` for k in ``ks_for(n)``, ``eval/avg@n`` and the weights version the completions came from.
    ``score`` returns a ``Scored``, or a reward (correct when > 0)."""
    rewards: list[list[float]] = [[] for _ in prompts]
    correct: list[int] = [0 for _ in prompts]
    for c in completions:
        s = score(c.prompt_index, list(c.token_ids))
        r, ok = (s.reward, s.correct) if isinstance(s, Scored) else (s, s is not None and s > 0)
        r = 0.0 if r is None or math.isnan(r) else float(r)
        rewards[c.prompt_index].append(r)
        correct[c.prompt_index] += bool(ok)
    for i, rs in enumerate(rewards):
        if len(rs) != n:
            raise RuntimeError(f"eval prompt {i} got {len(rs)} completions, expected n={n}")
    metrics: dict[str, float] = {}
    for k in ks_for(n):
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(rewards)
    metrics[f"eval/avg@{n}"] = sum(sum(rs) / n for rs in rewards) / len(rewards)
    versions = [c.weights_version for c in completions]
    if versions:
        top = max(set(versions), key=versions.count)
        metrics["eval/weight_version"] = float(top)
        metrics["eval/mixed_version_ratio"] = sum(v != top for v in versions) / len(versions)
    return metrics


def score_episodes(episodes: list, scores: object, rows: int, n: int, pass_reward: str) -> dict[str, float]:
    """pass@k of held-out episodes (``n`` per row of ``rows``, ``align.envs.episodes.Episode``) from their ``Scores``
    (``pass_reward`` decides a pass), and ``eval/first_turn_pass@1``: the share whose first turn already earned a
    positive reward, where turns carry rewards (an agent's episodes, ``align.gateway``, have only the agent's final
    reward: no first-turn figure, rather than a false 0). ``eval/errors``: the episodes that failed (an agent that
    raised, timed out or was refused; an environment error), counted as not passing; only when there are any."""
    results = iter([scored(*scores.item(j), pass_reward) for j in range(len(episodes))])
    metrics = score_completions([[0]] * rows, episodes, lambda i, ids: next(results), n)
    errors = [e.error for e in episodes if getattr(e, "error", None)]
    if errors:
        metrics["eval/errors"] = len(errors)
        last = (errors[0].strip().splitlines() or [""])[-1]
        log.warning(
            "%d of %d held-out episodes failed (scored as not passing); the first: %s", len(errors), len(episodes), last
        )
    if any(t.get("reward") is not None for e in episodes for t in e.turns):
        first = [bool(e.turns) and (e.turns[0].get("reward") or 0) > 0 for e in episodes]
        metrics["eval/first_turn_pass@1"] = sum(first) / len(first)
    return metrics


class GenerateClient:
    """A rollout client over a bare ``generate(prompts, params)`` (a pinned fleet's), for ``EvalSet.episodes``."""

    def __init__(self, generate: Callable[[list[list[int]], SamplingParams], list[Completion]]) -> None:
        self.generate = generate


def score_eval_set(
    eval_set, sampling: SamplingParams, generate: Callable[[list[list[int]], SamplingParams], list[Completion]]
) -> dict[str, float]:
    """Generate ``sampling.n`` completions per prompt of ``eval_set`` with ``generate`` and score them (an episode set:
    its episodes run on ``generate``, ``EvalSet.episodes``)."""
    if eval_set.episodes is not None:
        return eval_set.episodes(GenerateClient(generate), sampling)[0]
    completions = generate([list(p) for p in eval_set.prompts], sampling)
    return score_completions(eval_set.prompts, completions, eval_set.score, sampling.n)
