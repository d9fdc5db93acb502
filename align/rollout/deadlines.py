"""Group deadlines (``--group-timeout-s``, ``--evict-policy``): a step never waits forever on one group.

Three phases of a group have the deadline, each from its own start:

- **generation** on a spool client (a vLLM worker or fleet): ``generate_by_group`` sends each group as its own
  request (seeded as ``--max-inflight-requests`` = G would) from its own thread and waits until the deadline; a group
  not answered by then is evicted and its request abandoned: the thread keeps waiting for the worker's answer and
  drops it when it comes (within ``--rollout-timeout-s``). The native sampler generates every group in one batched
  in-process call: its deadline is the watchdog's (``--stall-timeout-s``).
- **environment steps** (``align.envs.episodes``): every episode of the round shares the deadline from its first
  ``open``; each environment call is cut at it (a worker's call: its worker killed and replaced, as for
  ``--env-timeout-s``; in process: the call is interrupted where Python can be, else abandoned on its daemon thread),
  a turn is not started past it, and on a spool client an episode whose turn is not back by then is abandoned.
- **rewards**: ``score_by_group`` scores each group of a round in its own thread and waits for all of them until the
  deadline from when scoring began; a reward stuck in a sleep keeps a daemon thread, nothing else.

A group past the deadline in any phase is *evicted* (``Groups.evicted``, ``rollout/evicted_groups``, an
``evicted_group`` record in completions.jsonl with the phase and why); the round's other groups are not held up by it.
What becomes of it is a row of ``EVICT_POLICIES``:

- ``refill``: the group is set aside and its prompt refilled from the data (``collect_groups`` samples another round,
  the DAPO refill machinery, within ``--max-refill-rounds``; if the rounds run out, the group trains masked);
- ``mask``: the group trains with its finished members' scores, the rest unscorable (NaN: no gradient); a group evicted
  in generation has no finished member.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from align import dist, heartbeat
from align.rewards import Scores

EVICT_POLICIES = {
    "refill": "the group is dropped and its prompt refilled from the data (within --max-refill-rounds)",
    "mask": "the group trains with its finished members' scores; the rest are unscorable",
}


def score_by_group(
    score: Callable[[list, list], Scores],
    items: list[tuple[dict, str]],
    comps: list,
    members: dict[int, list[int]],
    timeout_s: float,
    names: list[str],
) -> tuple[Scores, dict[int, str]]:
    """``items`` / ``comps`` of one round scored group by group (``members``: group -> its item indices) within
    ``timeout_s``. Returns the round's ``Scores`` (an item not scored by the deadline is NaN in every term) and the
    evicted groups, ``{group: why}``."""
    got: list[Scores | None] = [None] * len(items)
    done = {p: threading.Event() for p in members}
    errors: dict[int, BaseException] = {}

    def run(p: int, js: list[int]) -> None:
        try:
            for j in js:
                got[j] = score([items[j]], [comps[j]])
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below
            errors[p] = e
        finally:
            done[p].set()

    start = time.monotonic()
    threads = {
        p: threading.Thread(target=run, args=(p, js), name=f"align-group-{p}", daemon=True) for p, js in members.items()
    }
    for t in threads.values():
        t.start()
    deadline = start + timeout_s
    for ev in done.values():
        ev.wait(max(0.0, deadline - time.monotonic()))
    for e in errors.values():
        raise e
    evicted = {}
    for p, js in members.items():
        if not done[p].is_set():
            heartbeat.forget({threads[p].ident})  # abandoned: the watchdog no longer counts its call
            finished = sum(got[j] is not None for j in js)
            evicted[p] = (
                f"rewards past --group-timeout-s {timeout_s:g} ({finished} of {len(js)} completions scored in "
                f"{time.monotonic() - start:.1f} s)"
            )
    return _merge(got, names), evicted


def _merge(got: list[Scores | None], names: list[str]) -> Scores:
    out = Scores([], {n: [] for n in names})
    for s in got:
        if s is None:  # not scored by the deadline: unscorable
            out.totals.append(math.nan)
            for n in names:
                out.terms[n].append(math.nan)
            continue
        out.totals += s.totals
        for n in names:
            out.terms[n] += s.terms.get(n, [math.nan])
        out.errors += s.errors
        out.timeouts += s.timeouts
        if s.failed:
            out.failed_at.append(len(out.totals) - 1)
        out.failed += s.failed
    return out


class Sampled(list):
    """A round's completions (``collect_groups``' ``sample`` may return one) with the groups evicted while sampling:
    ``evicted`` = {prompt position in the round: why}."""

    def __init__(self, items: Any = (), evicted: dict[int, str] | None = None) -> None:
        super().__init__(items)
        self.evicted = dict(evicted or {})


def past_deadline(deadline: float) -> str:
    """Why a call was cut at a group's deadline (``time.monotonic()``)."""
    late = time.monotonic() - deadline
    return f"past its group's deadline (--group-timeout-s){f' by {late:.1f} s' if late >= 0.05 else ''}"


def generate_by_group(client: Any, prompts: list[list[int]], params: Any, timeout_s: float) -> Sampled:
    """``prompts``' groups (``params.n`` each), one request per group on its own thread, waited for ``timeout_s``
    from now; request ``i`` seeded like ``split_requests`` with ``permits = params.n``. A group not answered by then
    is evicted: its thread is abandoned (it takes the worker's answer when it comes and drops it) and it has no
    completions. A request that fails (the worker died) raises here."""
    from align.rollout.engines import split_requests

    requests = split_requests(prompts, params, params.n)
    got: list[list | None] = [None] * len(requests)
    errors: list[BaseException] = []

    def run(i: int, chunk: list, p: Any) -> None:
        try:
            got[i] = client.generate(chunk, p)
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below (unless abandoned)
            got[i] = []
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=(i, chunk, p), name=f"align-group-gen-{i}", daemon=True)
        for i, (_, chunk, p) in enumerate(requests)
    ]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, start + timeout_s - time.monotonic()))
    late = {i for i, t in enumerate(threads) if t.is_alive()}
    if errors:
        raise errors[0]
    heartbeat.forget({threads[i].ident for i in late})
    out = Sampled()
    for i, (first, _, _) in enumerate(requests):
        if i in late:
            out.evicted[first] = f"generation past --group-timeout-s {timeout_s:g} (no answer in {timeout_s:g} s)"
            continue
        out += [dataclasses.replace(c, prompt_index=c.prompt_index + first) for c in got[i] or []]
    return out


def check_deadline(cfg: Any) -> None:
    """``--group-timeout-s`` / ``--evict-policy`` against the rest of the config (``TrainConfig`` calls this)."""
    v = cfg.group_timeout_s
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"--group-timeout-s {v!r} is invalid: must be a finite number >= 0 (0 = off)")
    if cfg.evict_policy not in EVICT_POLICIES:
        raise ValueError(f"--evict-policy must be one of {tuple(EVICT_POLICIES)}, got {cfg.evict_policy!r}")
    if v and cfg.rollout != "native" and dist.env_world_size() > 1:  # generate_by_group's threads would each gather
        raise ValueError(
            f"--group-timeout-s {v:g} with --rollout {cfg.rollout} under torchrun is not supported yet (each rank "
            "would gather its groups' answers from several threads); run it in one process, or use --rollout native"
        )
    if v and v < MIN_GROUP_S:
        raise ValueError(f"--group-timeout-s {v!r} is invalid: below the minimum {MIN_GROUP_S} s (or 0 = off)")
    if v and cfg.rewards.reward_workers > 1:
        raise ValueError(
            f"--group-timeout-s {v:g} scores each group in its own thread in this process; --reward-workers "
            f"{cfg.rewards.reward_workers} scores in a pool whose calls --reward-timeout-s bounds already: use "
            "--reward-workers 1 with --group-timeout-s, or --reward-timeout-s with the pool"
        )


MIN_GROUP_S = 1.0  # the smallest --group-timeout-s (a reward call of a few tokens takes far less)
