"""Group deadlines (``--group-timeout-s``, ``--evict-policy``): a step never waits forever on one group's rewards.

``score_by_group`` scores each group of a round in its own thread, its completions one by one, and waits for all of
them until the deadline (``--group-timeout-s`` after scoring began). A group not finished by then is *evicted*, its
thread abandoned (a reward stuck in a sleep keeps a daemon thread, nothing else): the round's other groups are not
held up by it. What becomes of an evicted group is a row of ``EVICT_POLICIES``:

- ``refill``: the group is set aside and its prompt refilled from the data (``collect_groups`` samples another round,
  the DAPO refill machinery, within ``--max-refill-rounds``; if the rounds run out, the group trains masked);
- ``mask``: the group trains with its finished members' scores, the rest unscorable (NaN: no gradient).

Generation is one batched call of all groups (the native sampler cannot stall one group; a spool worker's answer is
bounded by ``--rollout-timeout-s``) and an episode's environment steps by ``--env-timeout-s``: the deadline covers
the rewards. Requires in-process rewards (``--reward-workers 1``): the groups' calls run concurrently.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from align import heartbeat
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


def check_deadline(cfg: Any) -> None:
    """``--group-timeout-s`` / ``--evict-policy`` against the rest of the config (``TrainConfig`` calls this)."""
    v = cfg.group_timeout_s
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"--group-timeout-s {v!r} is invalid: must be a finite number >= 0 (0 = off)")
    if cfg.evict_policy not in EVICT_POLICIES:
        raise ValueError(f"--evict-policy must be one of {tuple(EVICT_POLICIES)}, got {cfg.evict_policy!r}")
    if v and v < MIN_GROUP_S:
        raise ValueError(f"--group-timeout-s {v!r} is invalid: below the minimum {MIN_GROUP_S} s (or 0 = off)")
    if v and cfg.rewards.reward_workers > 1:
        raise ValueError(
            f"--group-timeout-s {v:g} scores each group in its own thread in this process; --reward-workers "
            f"{cfg.rewards.reward_workers} scores in a pool whose calls --reward-timeout-s bounds already: use "
            "--reward-workers 1 with --group-timeout-s, or --reward-timeout-s with the pool"
        )


MIN_GROUP_S = 1.0  # the smallest --group-timeout-s (a reward call of a few tokens takes far less)
