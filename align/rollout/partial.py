"""Partial rollouts (``--partial-rollouts``): over-sample, cut and carry, so a static-batch sampler never waits on the
long tail of a step (slime's ``--partial-rollout``, verl's ``partial_rollout``).

A step needs B groups. Its generate call holds the groups carried over from earlier calls (cut, unfinished) plus
fresh prompts, ``--partial-pool-factor`` (F, default 2) x B groups in all, and stops at a token boundary once B groups are complete (all G
rows finished); every row still running comes back cut (``finish_reason == "cut"``, never trained) with its ids and
logprobs so far. The B complete groups train; the rest are carried into the next call, which runs on the version the
pipeline gives the next step (one newer), so their later tokens come from newer weights. Every token carries the
version that sampled it (``Completion.token_versions``) and its own behaviour logprobs, so the loss's rho
correction (TIS / MIS, token / sequence / geometric: ``align.grpo``) corrects a completion spanning versions token
by token.

- ``generate_until``: the one operation, "generate until ``need`` groups are complete, return the rest cut", for the
  native sampler (``NativeClient.generate_until``). A resumed row continues with the rest of its ``max_tokens``:
  re-prefilled (``--partial-prefill recompute``: prompt + its ids so far under the new weights, exact) or on the KV
  cache it had at the cut (``keep``: the cache of every token fed before the cut, computed by the old weights; the
  last sampled token is fed under the new ones; the approximation peers make, which the learner's teacher-forced
  recompute and the rho correction see as off-policyness). A spool worker implements the same method (the worker's
  ``cut`` request; recompute only: a resumed row is a new request).
- ``Carry``: the carried groups of a run, as plain data for the checkpoint (``state``), and ``draw``: the step's
  groups from the carry plus fresh prompts (``align.rollout.groups.collect_groups``'s ``draw``).
- Staleness per token (``--max-token-staleness S``): a completion trained at step t holding a token sampled with
  version u has lag ``(t - 1) - u``; fresh tokens have lag K (``--max-async-steps``), carried ones K + the calls they
  waited. A carried group holding a token older than S is dropped before the call (``--stale-policy drop``: the call
  takes a fresh prompt in its place) or trained with those completions masked (``mask``: unscorable).
- ``lag_metrics``: ``rollout/partial_frac`` (completions spanning more than one version), ``rollout/token_lag_mean``,
  ``rollout/token_lag_max``.

Shapes: B groups a step needs, G rows per group, R rows in a call.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any

from align.rollout.cut import stitch, versions_of
from align.rollout.protocol import Completion, SamplingParams

PARTIAL_PREFILLS = ("recompute", "keep")
PARTIAL_CUTS = ("groups", "publish")  # --partial-cut: when a call's rows still running are cut
FILL_SEED_OFFSET = 104_729  # a fill call's seed: the step's + this (its uniforms are not the step call's again)
STALE_POLICIES = ("drop", "mask")
POOL_FACTOR = 2  # default --partial-pool-factor: a call holds this many times the groups it must complete


def check_config(cfg: Any, cuts: bool, prefills: tuple[str, ...] = ("recompute",)) -> None:
    """Value checks of the partial-rollout flags, before the model loads (``RolloutConfig.check_rollout``);
    ``cuts``: the backend can cut a generation at a token boundary, ``prefills``: the ``--partial-prefill`` modes it
    resumes a cut row by (its row of ``BACKENDS``)."""
    if cfg.partial_prefill not in PARTIAL_PREFILLS:
        raise ValueError(f"--partial-prefill must be one of {PARTIAL_PREFILLS}, got {cfg.partial_prefill!r}")
    if cfg.partial_cut not in PARTIAL_CUTS:
        raise ValueError(f"--partial-cut must be one of {PARTIAL_CUTS}, got {cfg.partial_cut!r}")
    if cfg.partial_cut == "publish" and not cfg.partial_rollouts:
        raise ValueError("--partial-cut publish decides when --partial-rollouts cut: add --partial-rollouts")
    if cfg.stale_policy not in STALE_POLICIES:
        raise ValueError(f"--stale-policy must be one of {STALE_POLICIES}, got {cfg.stale_policy!r}")
    F = cfg.partial_pool_factor
    if isinstance(F, bool) or not isinstance(F, int) or F < 2:
        raise ValueError(
            f"--partial-pool-factor must be an int >= 2 (a call holds F x the groups a step needs; 1 would wait for "
            f"every group, i.e. no partial rollouts), got {F!r}"
        )
    S = cfg.max_token_staleness
    if S is not None and (isinstance(S, bool) or not isinstance(S, int) or S < 0):
        raise ValueError(f"--max-token-staleness must be an int >= 0 (or unset = no limit), got {S!r}")
    if not cfg.partial_rollouts:
        return
    if cfg.max_async_steps < 1:
        raise ValueError(
            "--partial-rollouts carries cut generations into the next step's call, which needs the asynchronous "
            f"pipeline: add --max-async-steps 1 (or more); got --max-async-steps {cfg.max_async_steps}"
        )
    if S is not None and S < cfg.max_async_steps:
        raise ValueError(
            f"--max-token-staleness {S} is below --max-async-steps {cfg.max_async_steps}: every fresh token is "
            f"{cfg.max_async_steps} version(s) old when it trains, so every completion would be stale; use "
            f"--max-token-staleness >= {cfg.max_async_steps}"
        )
    if not cuts:
        raise ValueError(
            f"--partial-rollouts with --rollout {cfg.rollout}: that backend cannot cut a generation at a token "
            "boundary (its BACKENDS row has cuts = False); use --rollout native or spool, or drop --partial-rollouts"
        )
    if cfg.partial_prefill not in prefills:
        raise ValueError(
            f"--partial-prefill {cfg.partial_prefill} with --rollout {cfg.rollout}: that backend resumes a cut row "
            f"only by {' or '.join(prefills)} (the vLLM worker's cut resubmits prompt + ids so far, and its prefix "
            "cache is reset at every weight sync, so the old KV cache is gone); use --partial-prefill recompute, or "
            "--rollout native to keep the cache"
        )
    if getattr(getattr(cfg, "moe", None), "routing_replay", "off") != "off":
        raise ValueError(
            "--partial-rollouts does not stitch a resumed row's MoE routes yet: drop --routing-replay (or "
            "--partial-rollouts)"
        )
    if cfg.max_inflight_requests is not None:
        raise ValueError(
            "--partial-rollouts generates a step's pool of groups in one call; --max-inflight-requests does not "
            "apply to it yet: drop it (or drop --partial-rollouts)"
        )


# ------------------------------------------------------------------------------------------------ the operation


def generate_until(
    model: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    need: int,
    carried: list[Completion | None] | None,
    version: int,
    prefill: str = "recompute",
    kept: dict | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[Completion]:
    """The native sampler's "generate until ``need`` groups are complete, return the rest cut".

    ``prompts``: one per group, ``params.n`` rows each; ``carried``: per row (``len(prompts) * n``, prompt-major) the
    completion so far (a cut one resumes with the rest of ``max_tokens`` to go; a finished one comes back
    unchanged) or None (fresh). Returns one completion per row, finished or cut, with per-token versions (new
    tokens: ``version``). With nothing carried and ``need`` = every group, the call is exactly ``native.generate``'s.

    A cut row resumes by ``prefill``: ``"recompute"`` re-prefills its prompt + ids under the current weights;
    ``"keep"`` continues on the KV cache it had at the cut (``kept``: the client's store, which the call replaces
    with this call's cut rows; a row not in it, e.g. after a restart, recomputes). ``stop`` (``--partial-cut
    publish``): asked after every token; True cuts the rows still running before ``need`` groups are complete."""
    from align.rollout.native import Until, _generate, packed_weights

    if prefill not in PARTIAL_PREFILLS:
        raise ValueError(f"prefill must be one of {PARTIAL_PREFILLS}, got {prefill!r}")
    n = params.n
    R = len(prompts) * n
    carried = list(carried) if carried is not None else [None] * R
    if len(carried) != R:
        raise ValueError(f"carried has {len(carried)} rows, the call has {R} ({len(prompts)} prompts x n={n})")
    run = [r for r in range(R) if carried[r] is None or carried[r].finish_reason == "cut"]
    done_groups = len({r // n for r in range(R)} - {r // n for r in run})
    if done_groups >= need or not run:
        raise ValueError(f"{done_groups} of the {len(prompts)} groups are complete already; need {need}: no call")
    import torch

    with torch.inference_mode(), packed_weights(model, len(run)):
        if len(run) == R and all(c is None for c in carried):  # fresh groups: one shared prefill per prompt
            until = Until([r // n for r in range(R)], need, kept={} if prefill == "keep" else None, stop=stop)
            new = _generate(model, prompts, params, None, until=until)
        else:  # each running row its own prompt: the group's prompt + its ids so far
            rows = [prompts[r // n] + (carried[r].token_ids if carried[r] is not None else []) for r in run]
            budgets = [params.max_tokens - (len(carried[r].token_ids) if carried[r] is not None else 0) for r in run]
            keep = prefill == "keep"
            caches = [_take(kept, prompts[r // n], carried[r]) if keep else None for r in run]
            start = partial(_start, model, rows, caches)  # rows of like length prefilled together
            until = Until([r // n for r in run], need - done_groups, budgets, run, R, start, {} if keep else None, stop)
            new = _generate(model, rows, dataclasses.replace(params, n=1), None, until=until)
    out = list(carried)
    for r, c in zip(run, new):
        c = dataclasses.replace(c, weights_version=version)  # the tokens this call sampled
        joined = c if carried[r] is None else stitch(carried[r], c)  # the cut row's tokens keep their versions
        out[r] = dataclasses.replace(joined, prompt_index=r // n, sample_index=r % n)
    if kept is not None:  # only this call's cut rows resume next: the store holds nothing older
        kept.clear()
        for i, cache in (until.kept or {}).items():
            kept.setdefault(_key(prompts[run[i] // n], out[run[i]]), []).append(cache)
    return out


# ------------------------------------------------------------------------------------------------ keep


def _key(prompt: list[int], c: Completion) -> tuple:
    """A cut row's identity in the store: its prompt, ids and their versions (what its cache was computed from)."""
    return tuple(prompt), tuple(c.token_ids), tuple(versions_of(c))


def _take(kept: dict | None, prompt: list[int], c: Completion | None) -> tuple | None:
    """The cache ``kept`` holds for the cut row ``c`` (removed from the store), or None (a fresh row, or not kept)."""
    caches = None if kept is None or c is None else kept.get(_key(prompt, c))
    return caches.pop() if caches else None


def _buckets(rows: list[list[int]], idx: list[int]) -> list[list[int]]:
    """``idx`` grouped by the power of two their row's length falls in: a prefill pads each row to its bucket's
    longest (less than 2x its own length), not to the call's longest; a few prefills instead of one."""
    out: dict[int, list[int]] = {}
    for i in idx:
        out.setdefault(len(rows[i]).bit_length(), []).append(i)
    return [out[k] for k in sorted(out)]


def _start(model: Any, rows: list[list[int]], caches: list, max_len: int, dtype: Any) -> tuple:
    """A resumed call's first cache and logits (``native.Until.start``). A row with a kept cache (``--partial-prefill
    keep``: every token of ``rows[i]`` but the last, computed by older weights) gets its last token fed under the
    current weights on it; the others are prefilled (prompt + ids), rows of like length together (``_buckets``:
    a fresh prompt is not padded to the longest carried row, whose prefix can be the whole ``max_tokens``). Each
    right-aligned at the longest row, L."""
    import torch

    from align.attention import KVCache
    from align.rollout.native import prefill

    L = max(len(r) for r in rows)
    kept = [i for i, c in enumerate(caches) if c is not None]
    fresh = [i for i, c in enumerate(caches) if c is None]
    device = model.lm_head.weight.device
    cache = KVCache(model.config, len(rows), max_len, dtype, device)
    logits = torch.empty(len(rows), model.config.vocab_size, device=device)
    parts = [
        (b, prefill(model, [rows[i] for i in b], max(len(rows[i]) for i in b), dtype)) for b in _buckets(rows, fresh)
    ]
    if kept:
        sub = KVCache(model.config, len(kept), L, dtype, device)
        for b, i in enumerate(kept):
            k, v = caches[i]
            sub.k[:, b, :, L - 1 - k.shape[2] : L - 1], sub.v[:, b, :, L - 1 - k.shape[2] : L - 1] = k, v
            sub.valid[b, L - 1 - k.shape[2] :] = True
        sub.length = L - 1
        last = torch.tensor([[rows[i][-1]] for i in kept], device=device)
        pos = torch.tensor([[len(rows[i]) - 1] for i in kept], device=device)
        hidden = model(last, positions=pos, cache=sub, return_hidden=True)  # (B, 1, E)
        sub.length = L
        parts.append((kept, (sub, model.lm_head(hidden)[:, 0])))
    for idx, (sub, lg) in parts:
        at = torch.tensor(idx, device=device)
        S = sub.length
        cache.k[:, at, :, L - S : L], cache.v[:, at, :, L - S : L] = sub.k[:, :, :, :S], sub.v[:, :, :, :S]
        cache.valid[at, L - S : L] = sub.valid[:, :S]
        logits[at] = lg.to(logits.dtype)
    cache.length = L
    return cache, logits


# ------------------------------------------------------------------------------------------------ the carry


def group_complete(rows: list[Completion | None]) -> bool:
    return all(c is not None and c.finish_reason != "cut" for c in rows)


class Carry:
    """The groups a run carries between generate calls: ``[{"row": data row, "completions": [G completion dicts or
    None]}]`` in pool order (oldest first); ``state()`` is what a checkpoint stores (plain data)."""

    def __init__(
        self,
        group_size: int,
        max_token_staleness: int | None,
        policy: str,
        state: list | None = None,
        pool_factor: int = POOL_FACTOR,
        prefill: str = "recompute",
        cut: str = "groups",
    ):
        self.G, self.S, self.policy, self.pool_factor = group_size, max_token_staleness, policy, pool_factor
        self.prefill, self.cut = prefill, cut  # --partial-prefill: how the client resumes a cut row; --partial-cut
        self.last: tuple | None = None  # the last call's (prompt_of, params, client): what a fill continues with
        self.groups: list[tuple[int, list[Completion]]] = [
            (int(g["row"]), [Completion.from_dict(c) for c in g["completions"]]) for g in state or []
        ]
        self.dropped = 0  # completions dropped as stale (drop) or masked (mask), run total

    def state(self) -> list[dict]:
        return [{"row": i, "completions": [c.to_dict() for c in cs]} for i, cs in self.groups]

    def snapshot(self) -> list:
        """What ``state()`` gives now, made plain data only when read (``plain``): the pipeline takes two per step
        and a checkpoint reads few (``to_dict`` of every carried completion cost ~5% of a producer's step). The
        carried completions are never changed in place, so holding them is enough. A subclass's own ``state``
        (episodes: ``align.envs.partial``) is taken at once."""
        if type(self).state is not Carry.state:
            return self.state()
        return [(i, list(cs)) for i, cs in self.groups]

    def too_old(self, c: Completion, t: int) -> bool:
        return self.S is not None and bool(c.token_ids) and (t - 1) - min(versions_of(c)) > self.S

    def _drop_stale(self, pool: list, t: int, row: Callable[[Any], Any] = lambda c: c) -> tuple[list, list]:
        """``--stale-policy drop``: ``(kept, dropped)``, the groups of ``pool`` without and with a row (``row(x)``: a
        member's Completion or Episode) holding a token older than S; the dropped ones are counted in ``dropped``."""
        if self.policy != "drop" or self.S is None:
            return pool, []
        stale = [any(self.too_old(row(x), t) for x in xs) for _, xs in pool]
        old = [g for g, s in zip(pool, stale) if s]
        self.dropped += sum(len(xs) for _, xs in old)
        return [g for g, s in zip(pool, stale) if not s], old

    def _take(self, pool: list, need: int, complete: Callable[[list], bool]) -> list:
        """The first ``need`` groups of ``pool`` that are ``complete`` (pool order); the others stay carried."""
        take = [k for k, (_, xs) in enumerate(pool) if complete(xs)][:need]
        chosen = set(take)
        self.groups = [g for k, g in enumerate(pool) if k not in chosen]
        return [pool[k] for k in take]

    def draw(
        self,
        t: int,
        need: int,
        next_prompts: Callable[[int], list[int]],
        prompt_of: Callable[[int], list[int]],
        params: SamplingParams,
        client: Any,
    ) -> tuple[list[int], list[Completion]]:
        """Step ``t``'s ``need`` complete groups: ``(rows, completions)`` with ``prompt_index`` indexing ``rows``.
        The carried groups go first (oldest first), fresh prompts fill the pool to ``pool_factor * need``."""
        pool, _ = self._drop_stale(self.groups, t)
        if sum(group_complete(cs) for _, cs in pool) < need:
            fresh = next_prompts(max(0, self.pool_factor * need - len(pool)))
            pool = pool + [(i, [None] * self.G) for i in fresh]
            pool = self._call(pool, need, prompt_of, params, client)
            self.last = prompt_of, params, client
        taken = self._take(pool, need, group_complete)
        out = [dataclasses.replace(c, prompt_index=p) for p, (_, cs) in enumerate(taken) for c in cs]
        return [i for i, _ in taken], out

    def _call(self, pool: list, need: int, prompt_of: Callable, params: SamplingParams, client: Any, **kw) -> list:
        """``pool`` after one ``generate_until`` call that stops once ``need`` of its groups are complete."""
        flat = [c for _, cs in pool for c in cs]
        if self.prefill != "recompute":  # a spool client has only recompute
            kw["prefill"] = self.prefill
        comps = client.generate_until([prompt_of(i) for i, _ in pool], params, need, flat, **kw)
        return [(i, comps[k * self.G : (k + 1) * self.G]) for k, (i, _) in enumerate(pool)]

    def fill(self, stop: Callable[[], bool]) -> int:
        """``--partial-cut publish``: the carried rows still running decode on the weights the last call had until
        ``stop()`` (the pipeline: the next step's version is published) or every carried group is complete, then
        are cut; what the producer does instead of waiting. Returns the tokens it sampled. A fill is seeded apart
        from the step's call (``FILL_SEED_OFFSET``) and moves no data cursor; a checkpoint's carry is the one
        stored with its last batch, so a resumed run samples these tokens again (not bit-identically: when the
        cut comes depends on the trainer's timing)."""
        pool = self.groups  # every member a Completion: carried groups come out of a call (or a checkpoint)
        if self.last is None or all(group_complete(cs) for _, cs in pool) or stop():
            return 0
        prompt_of, params, client = self.last
        seed = None if params.seed is None else params.seed + FILL_SEED_OFFSET
        before = sum(len(c.token_ids) for _, cs in pool for c in cs)
        self.groups = self._call(pool, len(pool), prompt_of, dataclasses.replace(params, seed=seed), client, stop=stop)
        return sum(len(c.token_ids) for _, cs in self.groups for c in cs) - before

    def mask_stale(self, t: int, groups: Any) -> None:
        """``--stale-policy mask``: the completions of ``groups`` (step ``t``) holding a token older than S become
        unscorable (NaN: no advantage, no loss)."""
        if self.policy != "mask" or self.S is None:
            return
        for j, c in enumerate(groups.completions):
            if self.too_old(c, t):
                groups.scores.totals[j] = math.nan
                for v in groups.scores.terms.values():
                    v[j] = math.nan
                self.dropped += 1


def plain(carry: list) -> list[dict]:
    """A ``Carry.snapshot`` (or ``Carry.state``, as a checkpoint stores it) as ``state``'s plain data."""
    return [g if isinstance(g, dict) else {"row": g[0], "completions": [c.to_dict() for c in g[1]]} for g in carry]


def check_versions(t: int, v: int, completions: list[Completion]) -> None:
    """The pipeline's check under partial rollouts: step ``t``'s completions are finished and every token comes
    from version ``v`` (the step's) or older (the per-token bound is ``--max-token-staleness``)."""
    newer = sorted({u for c in completions for u in versions_of(c) if u > v})
    cut = sum(c.finish_reason == "cut" for c in completions)
    if newer or cut:
        raise RuntimeError(
            f"the rollouts of step {t} (partial rollouts) must be finished and come from weights version {v} or "
            f"older, but hold tokens of version(s) {newer} and {cut} cut completion(s): the engine missed a weight "
            "update"
        )


def lag_metrics(completions: list[Completion], t: int) -> dict:
    """Per-token staleness of step ``t``'s completions: the lag of a token sampled with version u is ``(t-1) - u``
    (an episode's policy tokens only)."""

    def policy(c: Completion) -> list[int]:  # an episode's environment tokens (mask False) are not sampled
        mask = getattr(c, "mask", None)
        return [v for j, v in enumerate(versions_of(c)) if mask is None or mask[j]]

    lags = [(t - 1) - v for c in completions for v in policy(c)]
    spans = sum(len(set(policy(c))) > 1 for c in completions)
    return {
        "rollout/partial_frac": spans / max(1, len(completions)),
        "rollout/token_lag_mean": sum(lags) / max(1, len(lags)),
        "rollout/token_lag_max": max(lags, default=0),
    }
