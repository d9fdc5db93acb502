"""Partial rollouts on environment tasks (``--partial-rollouts`` with ``--env``, ``--task multiturn``, ``--tools``,
``--env lean``): episodes are carried across weight versions, cut at a token boundary, inside a turn if need be.

The single-turn design (``align.rollout.partial``) with an episode for a completion: a step's call holds the carried
groups plus fresh rows, ``--partial-pool-factor`` x B groups in all, and runs turn waves (``EpisodeRunner``'s native
sampler path) until B groups are complete (every episode done). Inside a wave a group's ended turns are stepped in
their environments as soon as each episode of the group is done or has ended its turn, so the call stops at the
token where the B-th group completed: every turn still being sampled then is cut there (``Session``'s ``stop``), its
ids, logprobs and version so far kept on the episode as a turn ending ``"cut"``. Every episode still running is
carried, its environment kept open, into the next call, which runs on the next version: its ids so far (the first
prompt, its turns, the environment's replies, a cut turn's tokens) are re-prefilled under the newer weights
(``--partial-prefill recompute``) and a cut turn goes on with the rest of its budget; the environment steps it when
it ends, as one answer. So a long turn (a prover's first proof) never holds a call to its end: tokens < j of a turn
cut at j keep version v and its behaviour logprobs, tokens >= j are v + 1's; a correction turn (the Lean
environment's feedback, then the policy's next try) is one more segment. ``Episode.token_versions`` stamps every
token (an environment token: the version its turn ended on; it stays masked, logprob 0), so
``--max-token-staleness`` / ``--stale-policy``, the lag metrics and the rho correction work per token as for
single-turn completions. The decode waits on those environment steps inside the wave, so where a call stops depends
on the tokens and the environment's answers only (a seeded run reproduces); the cost: a wave's steps run in smaller
batches (a group's, as it ends) while the decode waits, where without ``--partial-rollouts`` they are one batch at the
wave's end.

Checkpoints: ``state()`` is plain data (each carried episode as sampled: ids, logprobs, mask, turns, messages,
versions; a cut turn is its last turn, ``finish_reason == "cut"``). A resumed run has no live environment for them:
each is replayed (a new instance, ``reset()``, then ``step()`` with each recorded assistant turn, no sampling; a cut
turn's tokens are re-added, segment by segment, and not stepped) and kept only if the replay renders the recorded
environment tokens exactly; an environment whose replay differs (not deterministic) has that group dropped (counted
in ``rollout/dropped_stale``, logged) and a fresh row takes its place. The next call continues a cut turn from its
recorded ids.

Not here: a spool worker or fleet (episodes run one thread each there), torchrun, ``--partial-prefill keep`` (a
carried episode is re-prefilled), ``--group-timeout-s`` and an environment that draws its own rows (``draws``: the
Lean correction queue, ``--lean-correction-fraction``): each refused with ``--partial-rollouts`` before any
sampling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from align.envs.episodes import EpisodeRunner, _failed, _Live
from align.rollout.cut import versions_of
from align.rollout.groups import Episode
from align.rollout.partial import POOL_FACTOR, Carry
from align.rollout.protocol import SamplingParams

log = logging.getLogger(__name__)


class EpisodeCarry(Carry):
    """The groups of episodes a run carries between steps: ``[(row index, [G _Live])]`` in pool order (oldest
    first), each episode's environment open. ``runner()``: the run's ``EpisodeRunner`` (it exists once the sampler
    started)."""

    def __init__(
        self,
        runner: Callable[[], EpisodeRunner],
        group_size: int,
        max_token_staleness: int | None,
        policy: str,
        state: list | None = None,
        pool_factor: int = POOL_FACTOR,
    ):
        super().__init__(group_size, max_token_staleness, policy, None, pool_factor)
        self.runner = runner
        # restored from a checkpoint: (row, [(Episode, done)]) until replayed in the first draw
        self.restored: list[tuple[int, list[tuple[Episode, bool]]]] = [
            (int(g["row"]), [(Episode(**{**c, "routes": None}), bool(d)) for c, d in zip(g["episodes"], g["done"])])
            for g in state or []
        ]
        self.groups: list[tuple[int, list[_Live]]] = []  # type: ignore[assignment]

    def state(self) -> list[dict]:
        """Plain data: per group its row, its episodes as sampled so far and whether each is done."""
        held = [(i, [(e.ep, e.done) for e in lives]) for i, lives in self.groups] + self.restored
        return [{"row": i, "episodes": [ep.to_dict() for ep, _ in eps], "done": [d for _, d in eps]} for i, eps in held]

    def draw(
        self,
        t: int,
        need: int,
        next_prompts: Callable[[int], list[int]],
        prompt_of: Callable[[int], dict],
        params: SamplingParams,
        client: Any,
    ) -> tuple[list[int], list[Episode]]:
        """Step ``t``'s ``need`` complete groups of episodes: ``(rows, episodes)`` with ``prompt_index`` indexing
        ``rows``. ``prompt_of(i)``: row ``i`` of the data."""
        from align.envs.episodes import _native_model

        runner = self.runner()
        model, sharded = _native_model(client)
        if model is None or sharded:
            raise RuntimeError("--partial-rollouts on an environment task runs on the native sampler in one process")
        if self.restored:  # a resumed run: replay each carried episode's environment
            restored, self.restored = self.restored, []
            for i, eps in restored:
                lives = [finished(runner, ep) if done else replay(runner, ep, prompt_of(i)) for ep, done in eps]
                if all(e is not None for e in lives):
                    self.groups.append((i, lives))
                    continue
                log.warning("a carried group of row %d does not replay in its environment: dropped", i)
                self.dropped += len(eps)
                close(runner, [e for e in lives if e is not None])
        pool, old = self._drop_stale(self.groups, t, lambda e: e.ep)
        close(runner, [e for _, lives in old for e in lives])
        if sum(group_done(lives) for _, lives in pool) < need:
            fresh = next_prompts(max(0, self.pool_factor * need - len(pool)))
            pool = pool + [(i, start(runner, prompt_of(i), self.G)) for i in fresh]
            flat = [e for _, lives in pool for e in lives]
            for k, (_, lives) in enumerate(pool):  # this call's layout: the row id of each episode, its group
                for g, e in enumerate(lives):
                    e.index, e.ep.prompt_index, e.ep.sample_index = k * self.G + g, k, g
            try:
                runner._run_native(model, client, flat, params, need=need)
            except BaseException:
                close(runner, flat)
                self.groups = []
                raise
        rows, out = [], []
        for p, (i, lives) in enumerate(self._take(pool, need, group_done)):
            rows.append(i)
            close(runner, lives)
            for e in lives:
                e.ep.prompt_index = p
                out.append(e.finish())
        return rows, out

    def close(self) -> None:
        """End the carried episodes' environments (the run ends)."""
        runner = self.runner()
        if runner is not None:
            close(runner, [e for _, lives in self.groups for e in lives])
        self.groups = []


def group_done(lives: list[_Live]) -> bool:
    """A complete group: every episode done."""
    return all(e.done for e in lives)


def _new_live(runner: EpisodeRunner, sample: int) -> _Live:
    with runner._lock:
        key = runner._next_key
        runner._next_key += 1
    return _Live(key, 0, 0, sample, runner)


def start(runner: EpisodeRunner, row: dict, G: int) -> list[_Live]:
    """G fresh episodes of ``row``: opened and reset (a failure is that episode's error, as ``EpisodeRunner.run``)."""
    lives = [_new_live(runner, g) for g in range(G)]
    opened = runner._calls([(e, "open", (row,)) for e in lives])
    todo = [e for e, res in zip(lives, opened) if not _failed(e, res)]
    for e, obs in zip(todo, runner._calls([(e, "reset", ()) for e in todo])):
        if not _failed(e, obs):
            e.begin(obs)
    return lives


def finished(runner: EpisodeRunner, ep: Episode) -> _Live:
    """A carried episode that is done: as recorded (its environment needs no replay)."""
    e = _new_live(runner, ep.sample_index)
    e.ep, e.rewards, e.done = ep, [t["reward"] for t in ep.turns], True
    return e


def replay(runner: EpisodeRunner, ep: Episode, row: dict) -> _Live | None:
    """A carried episode's environment rebuilt after a resume: ``reset()``, then ``step()`` with each recorded turn's
    text; the episode as recorded when the environment answers as it did, else None (closed)."""
    e = _new_live(runner, ep.sample_index)
    e.ep.prompt_index = ep.prompt_index
    try:
        stamps = versions_of(ep)
        runner.envs.open(e.key, row)
        e.begin(runner.envs.reset(e.key))
        at = 0
        for turn in ep.turns:
            n, m = turn["policy_tokens"], turn["env_tokens"]
            for a, b in segments(stamps, at, at + n):  # a turn cut inside: one segment per version, as sampled
                finish = turn["finish_reason"] if b == at + n else "cut"
                text = e.add_turn(ep.token_ids[a:b], ep.logprobs[a:b], ep.sampled_logprobs[a:b], finish, stamps[a])
            if turn["finish_reason"] == "cut" or e.done or e.add_step(runner.envs.step(e.key, text)) is None:
                break  # a cut turn is the last one recorded: it goes on in the next call
            at += n + m
    except Exception as err:  # noqa: BLE001 -- an environment that fails on replay: the group is dropped
        log.warning("replaying a carried episode failed: %s", err)
        e.done = True
    same = (e.ep.prompt_ids, e.ep.token_ids, e.ep.mask, e.ep.token_versions, e.ep.weights_version) == (
        ep.prompt_ids,
        ep.token_ids,
        ep.mask,
        ep.token_versions,
        ep.weights_version,
    )
    if e.done or not same:
        runner.envs.close_episode(e.key)
        return None
    return e


def segments(stamps: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """The runs of one version in ``stamps[lo:hi]`` (a turn's tokens): ``[(start, end)]``."""
    cuts = [j for j in range(lo + 1, hi) if stamps[j] != stamps[j - 1]]
    return list(zip([lo, *cuts], [*cuts, hi]))


def close(runner: EpisodeRunner, lives: list[_Live]) -> None:
    for e in lives:
        runner.envs.close_episode(e.key)
