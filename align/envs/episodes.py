"""Running episodes: the policy and an environment take turns until the environment is done, a budget runs out or
``--max-turns`` is reached; the result is one ``Episode`` per (row, sample), laid out for the learner exactly as
sampled (token-in/token-out).

An ``Episode`` is a ``Completion`` whose ``token_ids`` are every token after the first prompt: each turn's sampled
ids (ending with the stop token) followed by the environment's reply as suffix ids (``align.chat.TurnRenderer``:
the template's junction tokens, the messages, the next generation prompt). ``mask`` is True on the policy's tokens
only; the environment's tokens have logprob 0.0 and mask False, so they are context for the loss, the KL, the entropy
bonus, every normaliser and the rho correction.

Budgets: a turn's ``max_tokens`` = min(``--max-tokens``, what is left of ``--max-episode-tokens``, what is left of the
context). A turn cut by its budget (the environment still scores it), or an observation that does not fit what is
left, ends the episode as ``length`` (``truncated``; an observation is never cut mid-way).

Concurrency: on the native sampler (``align.rollout.sessions``) the live episodes' next turns are one batched
generate and each keeps its KV cache; on a spool client (a vLLM worker or a fleet) each episode runs on its own thread
and submits its next turn as soon as its environment step returns (no barrier across episodes; the permit pool of
``--max-inflight-requests`` bounds what is in flight).

Failures: an environment call that raises, times out or returns the wrong type (a message without string content, a
reward float32 cannot hold), a first prompt the chat template cannot render or that has no tokens, an observation it
cannot render, rewards that combine beyond float32: each makes that episode unscorable (``error``, counted in
``env/errors``); the step goes on. ``collect_episodes`` raises when every episode of a step failed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from align.data import MAX_BYTES_PER_TOKEN
from align.envs import EnvError
from align.rewards import FLOAT32_MAX
from align.rollout.groups import Episode
from align.rollout.protocol import SamplingParams

log = logging.getLogger(__name__)


def combine_rewards(rewards: list[float | None], how: str) -> float | None:
    given = [r for r in rewards if r is not None]
    if not given:
        return None
    return given[-1] if how == "last" else float(sum(given))


class _Live:
    """One episode while it runs: its ids so far and the turn bookkeeping shared by both schedulers."""

    def __init__(self, key: int, index: int, row: int, sample: int, runner: EpisodeRunner) -> None:
        self.key, self.index, self.runner = key, index, runner  # key: unique in the run; index: within its call
        self.ep = Episode(row, sample, [], [], "stop", [], 0)
        self.rewards: list[float | None] = []
        self.done = False
        # --group-timeout-s: on a spool client the group's deadline (time.monotonic()); on the native sampler what is
        # left of the episode's environment time (its own calls)
        self.deadline = self.env_left = math.inf
        self.lock = threading.Lock()  # a spool client's episode thread vs the eviction at the deadline

    def fail(self, e: EnvError) -> None:
        self.ep.error = str(e)
        from align.envs.runner import EnvEvicted, EnvTimeout

        self.ep.timed_out = isinstance(e, EnvTimeout)
        if isinstance(e, EnvEvicted):
            self.ep.evicted = str(e)
        self.done = True

    def past(self) -> bool:
        """Past the group's deadline: the episode is evicted (no further turn starts)."""
        if self.done or time.monotonic() < self.deadline:
            return False
        from align.envs.runner import EnvEvicted
        from align.rollout.deadlines import past_deadline

        self.fail(EnvEvicted(f"turn {len(self.ep.turns) + 1}: {past_deadline(self.deadline)}"))
        return True

    def begin(self, obs: list[dict] | str) -> None:
        size = self.runner.too_big(obs, self.runner.context)
        if size is not None:  # refused before tokenizing (a 20 MB text took minutes and GBs to tokenize)
            return self.fail(
                EnvError(
                    f"reset() returned {size} bytes: more than the context of {self.runner.context} tokens can hold"
                )
            )
        self.ep.messages = list(obs) if isinstance(obs, list) else [{"role": "user", "content": obs}]
        self.ep.chat = isinstance(obs, list)
        try:  # the chat template (or the tokenizer) on what the environment wrote: its episode's failure
            self.ep.prompt_ids = self.runner.renderer.first(obs)
        except ValueError as e:
            return self.fail(EnvError(f"reset()'s first prompt cannot be rendered: {e}"))
        if not self.ep.prompt_ids:
            return self.fail(EnvError(f"reset() returned {repr(obs)[:80]}: an empty first prompt (0 tokens)"))
        if len(self.ep.prompt_ids) >= self.runner.context:
            self.fail(
                EnvError(
                    f"the first prompt has {len(self.ep.prompt_ids)} tokens: no room in the context of "
                    f"{self.runner.context}"
                )
            )

    def budget(self, turn_cap: bool = True) -> int:
        """Tokens the next turn may sample: what is left of --max-episode-tokens and of the context, and (with
        ``turn_cap``) at most --max-tokens; without it, whether an observation fits before that turn."""
        r = self.runner
        used = len(self.ep.token_ids)
        left = r.max_tokens - self.cut_tokens() if turn_cap else r.context
        if r.cfg.max_episode_tokens:
            left = min(left, r.cfg.max_episode_tokens - used)
        return min(left, r.context - len(self.ep.prompt_ids) - used)

    def cut_tokens(self) -> int:
        """The tokens sampled so far of a turn cut inside (``--partial-rollouts``: its last turn ends ``"cut"``)."""
        turns = self.ep.turns
        return turns[-1]["policy_tokens"] if turns and turns[-1]["finish_reason"] == "cut" else 0

    def add_turn(self, ids: list[int], lps: list[float], slps: list[float], finish: str, version: int) -> str:
        """Record a sampled turn, or a segment of one: ``finish == "cut"`` (``--partial-rollouts``: the call stopped
        inside the turn) keeps the tokens so far, and the next segment (another call, newer weights) extends the same
        turn; its ``weights_version`` is then its last segment's. Returns the turn's text once it ended (the stop
        token dropped), else ""."""
        ep, before = self.ep, self.cut_tokens()
        stamp(ep, len(ids), version)
        ep.token_ids += ids
        ep.logprobs += lps
        ep.sampled_logprobs += slps
        ep.mask += [True] * len(ids)
        if before:  # the rest of a cut turn
            ep.turns[-1].update(policy_tokens=before + len(ids), finish_reason=finish, weights_version=version)
        else:
            ep.turns.append(
                {
                    "policy_tokens": len(ids),
                    "env_tokens": 0,
                    "finish_reason": finish,
                    "reward": None,
                    "weights_version": version,
                }
            )
        if finish == "cut":
            return ""
        text = self.runner.decode(ep.token_ids[len(ep.token_ids) - before - len(ids) :])
        ep.messages.append({"role": "assistant", "content": text})
        ep.text = text
        if finish == "length":  # cut by its budget: the environment still scores it, then the episode ends
            ep.finish_reason, ep.truncated = "length", True
        return text

    def add_step(self, st: Any) -> list[int] | None:
        """Record the environment's answer; returns the suffix ids to prefill next, or None when the episode ended."""
        ep, r = self.ep, self.runner
        ep.turns[-1]["reward"] = st.reward
        self.rewards.append(st.reward)
        info = st.info or {}
        ep.tool_calls += info.get("tool_calls", 0)
        ep.tool_errors += info.get("tool_errors", 0)
        if other := {k: v for k, v in info.items() if k not in ("tool_calls", "tool_errors")}:
            ep.turns[-1]["info"] = other  # the environment's own counts (e.g. the Lean verdict), kept per turn
        if st.observation is not None:
            obs = st.observation
            ep.messages += obs if isinstance(obs, list) else [{"role": "environment", "content": obs}]
            ep.chat = ep.chat and isinstance(obs, list)
        if st.done or ep.truncated or len(ep.turns) >= r.cfg.max_turns:
            self.done = True
            return None
        if r.too_big(st.observation, self.budget(turn_cap=False)) is not None:  # cannot fit: never tokenized
            ep.finish_reason, ep.truncated, self.done = "length", True, True
            return None
        try:
            suffix = r.renderer.suffix(st.observation)
        except ValueError as e:
            self.fail(EnvError(f"step()'s observation cannot be rendered: {e}"))
            return None
        room = self.budget(turn_cap=False) - len(suffix)  # an observation longer than --max-tokens may fit
        if room < 1:  # the observation and at least one policy token do not fit: ends as length, never cut
            ep.finish_reason, ep.truncated, self.done = "length", True, True
            return None
        stamp(ep, len(suffix), ep.turns[-1]["weights_version"])  # context, never trained: its turn's version
        ep.token_ids += suffix
        ep.logprobs += [0.0] * len(suffix)
        ep.sampled_logprobs += [0.0] * len(suffix)
        ep.mask += [False] * len(suffix)
        ep.turns[-1]["env_tokens"] = len(suffix)
        return suffix

    def finish(self) -> Episode:
        if not self.ep.prompt_ids:  # failed before its first prompt: one placeholder token, nothing to learn from
            self.ep.prompt_ids = [0]
        self.ep.env_reward = combine_rewards(self.rewards, self.runner.cfg.env_reward)
        if self.ep.error is None and not _fits_float32(self.ep.env_reward):  # --env-reward sum: each turn's fits
            self.ep.error = (
                f"the environment's rewards combine (--env-reward {self.runner.cfg.env_reward}) to "
                f"{self.ep.env_reward!r}, beyond float32 (|reward| <= {FLOAT32_MAX:.4g}): unscorable"
            )
        return self.ep


class EpisodeRunner:
    """Runs a step's episodes on a rollout client. ``envs``: an ``align.envs.runner.EnvRunner``; ``renderer``: an
    ``align.chat.TurnRenderer``; ``decode(ids) -> str`` drops a trailing stop token."""

    def __init__(
        self, envs: Any, renderer: Any, decode: Callable[[list[int]], str], cfg: Any, max_tokens: int, context: int
    ) -> None:
        self.envs, self.renderer, self.decode, self.cfg = envs, renderer, decode, cfg
        self.max_tokens, self.context = max_tokens, context
        self.token_bytes = getattr(getattr(renderer, "tok", None), "max_token_bytes", MAX_BYTES_PER_TOKEN)
        self._next_key = 0
        self._lock = threading.Lock()
        self.compared = False

    def too_big(self, obs: list[dict] | str, tokens: int) -> int | None:
        """The observation's size in bytes when it cannot fit in ``tokens`` tokens (no token of the tokenizer covers
        more than ``max_token_bytes``: the data prompts' byte limit), else None; linear, before any tokenizing."""
        texts = [obs] if isinstance(obs, str) else [m.get("content") for m in obs if isinstance(m, dict)]
        texts = [t for t in texts if isinstance(t, str)]
        bound = max(0, tokens) * self.token_bytes
        if 4 * sum(map(len, texts)) <= bound:  # UTF-8: at most 4 bytes a character
            return None
        size = sum(len(t.encode("utf-8", "replace")) for t in texts)
        return size if size > bound else None

    def run(
        self, client: Any, rows: list[dict], G: int, params: SamplingParams, timeout_s: float = 0.0
    ) -> list[Episode]:
        """G episodes of each row; returned in (row, sample) order, every one (failed ones carry ``error``).
        ``timeout_s`` > 0 (``--group-timeout-s``): every group's deadline, from now; an episode whose environment call
        or (spool client) turn is not back by then, or that would start a turn past it, is evicted
        (``Episode.evicted`` says why)."""
        with self._lock:
            first = self._next_key
            self._next_key += len(rows) * G
        live = [_Live(first + p * G + g, p * G + g, p, g, self) for p in range(len(rows)) for g in range(G)]
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else math.inf
        for e in live:
            e.deadline, e.env_left = deadline, timeout_s or math.inf
        try:
            opened = self._calls([(e, "open", (rows[e.ep.prompt_index],)) for e in live])
            todo = [e for e, res in zip(live, opened) if not _failed(e, res)]
            for e, obs in zip(todo, self._calls([(e, "reset", ()) for e in todo])):
                if not _failed(e, obs):
                    e.begin(obs)
            model, sharded = _native_model(client)
            if model is None:
                self._run_threads(client, [e for e in live if not e.done], params)
            elif not sharded:
                self._run_native(model, client, live, params)
            else:  # torchrun: each rank runs its share on the full weights; every rank gets every episode
                from align import dist

                lo, hi = dist.share(len(live))
                full = dist.full_model(model)
                self._run_native(full, client, live, params, range(lo, hi))
                del full
                mine = [e.finish() for e in live[lo:hi]]
                return [ep for part in dist.gather(mine) for ep in part]
        finally:
            for e in live:
                self.envs.close_episode(e.key)
        return [e.finish() for e in live]

    def _calls(self, calls: list[tuple[_Live, str, tuple]]) -> list:
        """``envs.call_many`` of the episodes' calls, each bounded by what is left of its episode's environment time
        (``--group-timeout-s``: the waits for the batched decode and for other episodes' calls do not count)."""
        now, took = time.monotonic(), []
        results = self.envs.call_many(
            [(e.key, op, a) for e, op, a in calls], [now + e.env_left for e, _, _ in calls], took
        )
        for (e, _, _), s in zip(calls, took):
            e.env_left -= s
        return results

    # ---------------------------------------------------------------------- the native sampler: turn waves

    def _run_native(
        self,
        model: Any,
        client: Any,
        live: list[_Live],
        params: SamplingParams,
        share: range | None = None,
        need: int | None = None,
    ) -> None:
        """Turn waves on one ``Session``; a row's id is its episode's index in ``live`` (its draws depend only on it),
        so a rank's ``share`` of the episodes samples what one process samples for them. An episode carried from an
        earlier call (``--partial-rollouts``) starts from its ids so far, re-prefilled under the current weights (a
        cut turn goes on where it was cut, with the rest of its budget).

        ``need`` (``align.envs.partial``): stop once that many groups (by ``prompt_index``) are complete, at the token
        boundary where the last of them ended; every turn still being sampled then is cut there (kept on its
        episode, to go on in the next call). Each group's ended turns are stepped in their environments as soon as
        every episode of the group is done or has ended its turn (the decode waits on those steps, so where the call
        stops depends on the tokens and the environment's answers only, never on timing); without ``need`` the
        wave's steps are one batch at its end."""
        from align.rollout.sessions import Session

        rows = [i for i in (share if share is not None else range(len(live))) if not live[i].done]
        if not rows:
            return
        version = getattr(client, "weights_version", 0)
        sess = Session(model, dataclasses.replace(params, n=1), total_rows=len(live))
        pending: dict[int, str] = {}  # rows whose turn ended, not stepped yet: its text
        suffixes: dict[int, list[int]] = {}  # rows stepped that go on: the environment's tokens to prefill
        recorded: set[int] = set()  # rows whose turn of this wave ``ended`` recorded
        members: dict[int, list[int]] = {}
        for i, e in enumerate(live):
            members.setdefault(e.ep.prompt_index, []).append(i)

        def record(i: int, t: Any) -> None:
            e = live[i]
            text = e.add_turn(t.token_ids, t.logprobs, t.sampled_logprobs, t.finish_reason, version)
            if not e.done and t.finish_reason != "cut":
                pending[i] = text

        def step(ids: list[int]) -> None:
            results = self._calls([(live[i], "step", (pending.pop(i),)) for i in ids])
            for i, st in zip(ids, results):
                if not _failed(live[i], st) and (suffix := live[i].add_step(st)) is not None:
                    suffixes[i] = suffix

        def ended(turns: list) -> bool:  # Session's ``stop``: rows ended their turn at this token
            for i, t in turns:
                recorded.add(i)
                record(i, t)
            groups = {live[i].ep.prompt_index for i, _ in turns}
            ready = [g for g in groups if all(live[j].done or j in pending for j in members[g])]
            step([j for g in ready for j in members[g] if j in pending])
            return complete_groups(live) >= need

        stop = ended if need is not None else None
        starts = [live[i].ep.prompt_ids + live[i].ep.token_ids for i in rows]
        turns = sess.start(starts, 1, [max(1, live[i].budget()) for i in rows], rows, stop)
        while True:
            for i, t in zip(rows, turns):
                if i not in recorded:
                    record(i, t)
            step([i for i in rows if i in pending])
            nxt = [i for i in rows if i in suffixes]
            if not nxt or (need is not None and complete_groups(live) >= need):
                return
            budgets = [live[i].budget() for i in nxt]
            new_ids = [suffixes.pop(i) for i in nxt]
            recorded.clear()
            turns = sess.next(nxt, new_ids, budgets, stop)
            rows = nxt

    # ---------------------------------------------------------------------- a spool client: one thread per episode

    def _run_threads(self, client: Any, live: list[_Live], params: SamplingParams) -> None:
        errors: list[BaseException] = []

        def episode(e: _Live) -> None:
            try:
                ids = list(e.ep.prompt_ids)
                while True:
                    # the draws depend on the call's seed and the episode's place in it, not on what ran before
                    # (a concurrent eval, a resumed run): a run replays its episodes exactly
                    seed = None if params.seed is None else params.seed + 7919 * e.index + 104_729 * len(e.ep.turns)
                    p = dataclasses.replace(params, n=1, max_tokens=e.budget(), seed=seed)
                    c = client.generate([ids], p)[0]
                    with e.lock:  # evicted meanwhile (the deadline passed): the answer is ignored
                        if e.done:
                            return
                        text = e.add_turn(
                            c.token_ids,
                            list(c.logprobs),
                            list(c.sampled_logprobs or c.logprobs),
                            c.finish_reason,
                            c.weights_version,
                        )
                    if e.done:
                        return
                    try:
                        st = self.envs.step(e.key, text, e.deadline)
                    except EnvError as err:
                        with e.lock:
                            if not e.done:
                                e.fail(err)
                        return
                    with e.lock:
                        if e.done or e.add_step(st) is None or e.past():
                            return
                    ids = e.ep.prompt_ids + e.ep.token_ids
            except BaseException as err:  # noqa: BLE001 -- a rollout failure (dead worker): raised by run()
                errors.append(err)

        threads = [
            threading.Thread(target=episode, args=(e,), name=f"align-episode-{e.key}", daemon=True) for e in live
        ]
        for t in threads:
            t.start()
        from align.envs.runner import CUT_GRACE_S

        deadline = live[0].deadline if live else math.inf
        for t in threads:  # a step cut at the deadline reports within the grace; a turn not back is abandoned
            t.join(None if deadline == math.inf else max(0.0, deadline + CUT_GRACE_S - time.monotonic()))
        late = [(e, t) for e, t in zip(live, threads) if t.is_alive()]
        if late:  # past the deadline (a turn or a step not back): evicted, the thread abandoned
            from align import heartbeat
            from align.envs.runner import EnvEvicted
            from align.rollout.deadlines import past_deadline

            heartbeat.forget({t.ident for _, t in late})
            for e, _ in late:
                with e.lock:
                    if not e.done:
                        e.fail(EnvEvicted(f"turn {len(e.ep.turns) + 1}: {past_deadline(deadline)} (not back)"))
        if errors:
            raise errors[0]


def stamp(ep: Episode, n: int, version: int) -> None:
    """Before ``n`` tokens of ``version`` are appended to ``ep``: its first token's version is ``weights_version``;
    ``token_versions`` holds each token's once two differ (``--partial-rollouts``: a carried episode's later tokens,
    the rest of a turn cut inside too, come from newer weights, ``align.envs.partial``), else None (every token from
    ``weights_version``)."""
    if not ep.token_ids:
        ep.weights_version = version
    elif ep.token_versions is not None or version != ep.weights_version:
        ep.token_versions = (ep.token_versions or [ep.weights_version] * len(ep.token_ids)) + [version] * n


def _fits_float32(v: float | None) -> bool:
    """None / NaN (no reward, an abstention) or a value a float32 tensor holds."""
    return v is None or math.isnan(v) or abs(v) <= FLOAT32_MAX


def complete_groups(live: list[_Live]) -> int:
    """How many groups (episodes sharing a ``prompt_index``) have every episode done."""
    running = {e.ep.prompt_index for e in live if not e.done}
    return len({e.ep.prompt_index for e in live} - running)


def _failed(e: _Live, result: Any) -> bool:
    if isinstance(result, EnvError):
        e.fail(result)
        return True
    return False


def _native_model(client: Any) -> tuple[Any, bool]:
    """(the model, sharded) of a native client (or of one behind a permit wrapper); (None, False) for spool clients."""
    from align.rollout.client import NativeClient, ShardedNativeClient

    for c in (client, getattr(client, "client", None)):
        if isinstance(c, (NativeClient, ShardedNativeClient)):
            return c.model, isinstance(c, ShardedNativeClient)
    return None, False


def env_stats(episodes: list[Episode]) -> dict[str, float]:
    """The ``env/*`` metrics of one step."""
    n = max(len(episodes), 1)
    return {
        "env/turns_mean": sum(len(e.turns) for e in episodes) / n,
        "env/policy_tokens_mean": sum(e.policy_tokens for e in episodes) / n,
        "env/env_tokens_mean": sum(len(e.token_ids) - e.policy_tokens for e in episodes) / n,
        "env/errors": sum(e.error is not None and not e.timed_out and not e.evicted for e in episodes),
        "env/timeouts": sum(e.timed_out for e in episodes),
        "env/truncated_frac": sum(e.truncated for e in episodes) / n,
        "env/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "env/tool_errors": sum(e.tool_errors for e in episodes),
    }


def episode_scores(episodes: list[Episode], items: list[tuple[dict, str]], scorer: Any, should_stop: Any = None) -> Any:
    """``Scores`` of a step's episodes: the environment's reward (term ``env``) plus the ``--reward`` functions on
    the final assistant message, if any. Unscorable (NaN): a failed episode, one whose reward function failed, and one
    with no reward at all (the environment gave none and every reward function abstained)."""
    from align.rewards import Scores

    base = scorer.score(items, should_stop) if scorer is not None else None
    out = Scores(
        [],
        {"env": [], **(base.terms if base else {})},
        list(base.errors) if base else [],
        base.timeouts if base else 0,
        base.failed if base else 0,
    )
    failed_reward = set(base.failed_at) if base else set()
    for j, e in enumerate(episodes):
        env = math.nan if e.env_reward is None or e.error else e.env_reward
        out.terms["env"].append(env)
        if e.error:
            out.errors.append(e.error)
            out.timeouts += e.timed_out
            out.failed += j not in failed_reward
        parts = [v for v in (env, base.totals[j] if base else math.nan) if math.isfinite(v)]
        if e.error is None and j not in failed_reward and not _fits_float32(sum(parts)):
            out.errors.append(f"the environment's reward and --reward's sum to {sum(parts)!r}, beyond float32")
            out.failed += 1
            failed_reward.add(j)
        bad = e.error is not None or j in failed_reward or not parts
        out.totals.append(math.nan if bad else float(sum(parts)))
        out.failed_at += [j] if e.error is not None or j in failed_reward else []
    return out
