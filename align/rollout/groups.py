"""A step's rollouts as named types (``Episode``: a multi-turn completion; ``Group``, ``Groups``), and the stage that
collects them: prompts -> groups of G scored completions.

``collect_groups`` samples ``P`` groups and scores them; with ``--adv-refill`` (DAPO's dynamic sampling, Yu et al.
2025) groups whose rewards do not differ (``has_signal``) are set aside and fresh prompts sampled until ``P`` groups
have signal or ``--max-refill-rounds`` run out. The result is one ``Groups``: flat per-completion lists in (prompt,
sample) order, with ``completions[j].prompt_index`` indexing ``idx``; ``tensors(G)`` lays them out as (P, G).

Shapes: P prompts (groups) in the step, G completions per group.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from align.rewards import Scores
from align.rollout.protocol import Completion

log = logging.getLogger(__name__)


def has_signal(totals: list[float]) -> bool:
    """A group teaches something only if its scorable rewards differ (DAPO's dynamic-sampling criterion)."""
    finite = [t for t in totals if math.isfinite(t)]
    return len(finite) >= 2 and max(finite) > min(finite)


@dataclass
class Episode(Completion):
    """One episode, as the learner reads it (a ``Completion`` with a per-token ``mask``) and as the log shows it."""

    prompt_ids: list[int] = field(default_factory=list)  # the first prompt (reset's render)
    mask: list[bool] = field(default_factory=list)  # per token of token_ids: True = sampled by the policy
    # per turn: policy_tokens, env_tokens, finish_reason, reward, version
    turns: list[dict] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversation: first prompt, then assistant / environment
    text: str = ""  # the final assistant message (what --reward functions score)
    env_reward: float | None = None  # the per-turn rewards combined (--env-reward); None: none given
    error: str | None = None  # the environment failed: unscorable
    timed_out: bool = False
    evicted: str | None = None  # past its group's deadline (--group-timeout-s): why (the group is evicted)
    truncated: bool = False  # a budget or the context ended it
    tool_calls: int = 0
    tool_errors: int = 0
    chat: bool = False  # every message is a chat message (a str prompt or observation makes it False)
    # the episode's other trajectories (an agent that edited its history: align.gateway.capture), each an Episode of
    # the same (prompt_index, sample_index) holding the tokens it sampled; trained with this episode's advantage
    branches: list = field(default_factory=list)

    def __post_init__(self) -> None:  # a checkpoint's pending batch holds them as dicts (Produced.from_state)
        self.branches = [b if isinstance(b, Episode) else Episode(**b) for b in self.branches]

    @property
    def policy_tokens(self) -> int:
        return sum(self.mask)


def trajectories(completions: list) -> list:
    """The sequences the learner trains, in order: each completion, then its episode's other trajectories
    (``Episode.branches``). Every trajectory of an episode carries its (prompt_index, sample_index), so it takes the
    episode's advantage: a group's normalisation counts each episode once (its reward once), and each sampled token
    is trained once, in the trajectory that sampled it (docs/agent.md "Branches")."""
    return [t for c in completions for t in (c, *getattr(c, "branches", ()))]


class Group(NamedTuple):
    """One prompt's completions, their texts and scores (``terms``: each reward's values)."""

    prompt: int  # index into the task's prompts
    completions: list
    texts: list[str]
    totals: list[float]
    terms: dict[str, list[float]]


class GroupTensors(NamedTuple):
    """A step's scores laid out (P, G) by (prompt_index, sample_index); NaN marks an unscorable completion."""

    total: torch.Tensor  # (P, G) float
    terms: dict[str, torch.Tensor]  # name -> (P, G) float
    lengths: torch.Tensor  # (P, G) float: completion tokens
    truncated: torch.Tensor  # (P, G) bool: finish_reason == "length"


@dataclass
class Groups:
    """The groups of one step. ``completions[j].prompt_index`` indexes ``idx``; ``texts`` and ``scores`` align
    with ``completions``; ``scores.errors`` / ``timeouts`` / ``failed`` count every round, ``scored`` the items."""

    idx: list[int]
    completions: list
    texts: list[str]
    scores: Scores
    rounds: int = 0
    sampled_prompts: int = 0
    signal_groups: int = 0
    scored: int = 0
    evicted: list[dict] = field(default_factory=list)  # --group-timeout-s: the groups evicted and why
    dropped_stale: int = 0  # --partial-rollouts: completions dropped or masked as stale (--max-token-staleness)

    def tensors(self, G: int) -> GroupTensors:
        """The scores, lengths and truncation flags as (P, G) tensors (a missing completion stays NaN / 0)."""
        P = len(self.idx)
        total = torch.full((P, G), math.nan)  # (P, G)
        terms = {n: torch.full((P, G), math.nan) for n in self.scores.terms}  # name -> (P, G)
        lengths = torch.zeros(P, G)  # (P, G)
        truncated = torch.zeros(P, G, dtype=torch.bool)  # (P, G)
        for j, c in enumerate(self.completions):
            at = (c.prompt_index, c.sample_index)
            total[at] = self.scores.totals[j]
            for n, v in self.scores.terms.items():
                terms[n][at] = v[j]
            lengths[at] = sum(c.mask) if getattr(c, "mask", None) else len(c.token_ids)  # policy tokens only
            truncated[at] = c.finish_reason == "length"
        return GroupTensors(total, terms, lengths, truncated)

    def check_reward_failures(self, step: int, first_error: list[str]) -> None:
        """Warn once per run when a reward call failed (``first_error`` holds its message) and at every step where
        no completion was scorable (no gradient); raise when every call of the step failed."""
        s = self.scores
        failures = s.errors or [f"{s.timeouts} reward call(s) timed out (--reward-timeout-s)"]
        if s.failed and not first_error:
            first_error.append(failures[0])
            log.warning("a reward call failed; the completion counts as unscorable:\n%s", failures[0])
        if s.failed == self.scored:
            raise RuntimeError(
                f"the reward function raised on every completion of step {step}; first error:\n{failures[0]}"
            )
        if self.scored and not any(math.isfinite(t) for t in s.totals):
            log.warning(
                "step %d: no completion was scorable (every reward abstained or failed): nothing to learn "
                "from in this step",
                step,
            )


def collect_groups(
    P: int,
    next_prompts: Callable[[int], list[int]],
    sample: Callable[[list[int], int], list],
    text_of: Callable[[object], str],
    record: Callable[[int], dict],
    score: Callable[[list[tuple[dict, str]], list], Scores],
    names: list[str],
    refill: bool = False,
    max_rounds: int = 0,
    group_timeout_s: float = 0.0,
    evict_policy: str = "refill",
    draw: Callable[[int, int], tuple[list[int], list]] | None = None,
) -> Groups:
    """Sample and score ``P`` groups. With ``refill`` (DAPO dynamic sampling), groups without reward variance are
    set aside and fresh prompts sampled (round r = 1..max_rounds) until ``P`` groups have signal; if the rounds
    run out, set-aside groups fill the batch (their advantages are zero). ``sample(idx, round)`` returns
    completions whose ``prompt_index`` indexes ``idx``; ``text_of(completion)`` is what the rewards read;
    ``score(items, completions)`` scores the (record, text) items (``names``: its terms; a run's stop flag rides in
    it: ``RewardScorer.score(items, should_stop)`` ends with ``Interrupted``). ``group_timeout_s`` > 0: each group's
    rewards within that deadline (``align.rollout.deadlines``), and a ``sample`` that returns a ``Sampled`` names the
    groups it evicted; an evicted group is refilled (another round, which ``max_rounds`` bounds: past it the group
    trains masked) or masked (``evict_policy``), and listed in ``Groups.evicted``. ``draw(need, round) -> (idx,
    completions)`` replaces ``next_prompts`` + ``sample`` (partial rollouts, ``align.rollout.partial.Carry.draw``: the
    groups come from carried and fresh rows)."""
    from align.rollout.deadlines import score_by_group

    kept: list[Group] = []
    dropped: list[Group] = []
    evicted: list[dict] = []  # {"prompt": row index, "round": r, "why": ..., "policy": ...}
    masked: list[Group] = []  # evicted groups set aside for refill: they train masked if the rounds run out
    errors: list[str] = []
    timeouts = failed = scored = sampled = rounds = 0
    need = P
    while True:
        if draw is not None:
            idx, comps = draw(need, rounds)
        else:
            idx = next_prompts(need)
            comps = sample(idx, rounds)
        sampled += len(idx)
        texts = [text_of(c) for c in comps]
        items = [(record(idx[c.prompt_index]), t) for c, t in zip(comps, texts)]
        members: dict[int, list[int]] = {}
        for j, c in enumerate(comps):
            members.setdefault(c.prompt_index, []).append(j)
        late: dict[int, str] = {}
        if group_timeout_s > 0:
            s, late = score_by_group(score, items, comps, members, group_timeout_s, names)
        else:
            s = score(items, comps)
        late.update(getattr(comps, "evicted", None) or {})  # evicted while sampling (generation, environment)
        errors += s.errors
        timeouts, failed, scored = timeouts + s.timeouts, failed + s.failed, scored + len(comps)
        for p, i in enumerate(idx):
            js = members.get(p, [])
            group = Group(
                i,
                [comps[j] for j in js],
                [texts[j] for j in js],
                [s.totals[j] for j in js],
                {n: [v[j] for j in js] for n, v in s.terms.items()},
            )
            if p in late:
                evicted.append({"prompt": i, "round": rounds, "why": late[p], "policy": evict_policy})
                log.warning("group of prompt %d evicted (%s): %s", i, evict_policy, late[p])
                if evict_policy == "refill":
                    masked.append(group)
                    continue
            (kept if not refill or has_signal(group.totals) else dropped).append(group)
        refill_now = evict_policy == "refill" and bool(late)  # evicted prompts to replace
        if (not refill and not refill_now) or len(kept) >= P or rounds >= max_rounds:
            break
        rounds += 1
        need = P - len(kept)
    final = (kept + dropped + masked)[:P]
    if evicted and not any(g.completions for g in final):
        raise RuntimeError(
            f"every group of the step was evicted (--group-timeout-s {group_timeout_s:g}); the first: "
            f"{evicted[0]['why']}. Raise --group-timeout-s, or find what hangs (the completions log names each)"
        )
    out = Groups(
        [],
        [],
        [],
        Scores([], {n: [] for n in names}, errors, timeouts, failed),
        rounds=rounds,
        sampled_prompts=sampled,
        signal_groups=sum(has_signal(g.totals) for g in final),
        scored=scored,
        evicted=evicted,
    )
    for p, g in enumerate(final):
        out.idx.append(g.prompt)
        out.completions += [dataclasses.replace(c, prompt_index=p) for c in g.completions]
        out.texts += g.texts
        out.scores.totals += g.totals
        for n, v in g.terms.items():
            out.scores.terms[n] += v
    return out
