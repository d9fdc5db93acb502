"""Partial rollouts on the spool (protocol minor version 2): the ``cut`` request, and ``stitch``, which joins a cut
completion with its continuation. stdlib only (the native sampler may stitch with it too).

    request  cut       {"requests": [generate request id, ...]}
    answer   cut_done  {"cut": [id, ...], "untouched": [id, ...]}

The worker answers every named generate request it has not answered yet (in the engine, or still queued in the
spool) with its ``completions`` message at once: a row that finished has its usual finish reason; every other row
has finish reason ``"cut"`` and the tokens and logprobs sampled so far (zero or more: a row still in prefill, or a
request the worker had not started, has none), on the same logprob basis as a finished row. Those ids are listed in
``cut``; an id already answered (or unknown to the worker) is left as it is and listed in ``untouched``. The
``cut_done`` answer is published after the completions it lists, so once it is read, ``client.generate(prompts,
params, request_id=id)`` collects each cut request's rows without waiting. A cut request jumps the queue: the worker
serves it between two engine steps, even while its batch is full or a weight sync waits for the engine to drain.

Resumption: a cut row continues as a new ``generate`` whose prompt is the original prompt + the row's ids so far and
whose ``max_tokens`` is what was left (``continuation_prompt``); the vLLM worker's prefix cache makes the prefill
cheap, and it is reset on every weight sync, so the continuation's logprobs are the new weights'. ``stitch`` joins
the two answers into one completion, each token stamped with the version that sampled it (``token_versions``).

Versions: ``cut`` refuses a worker below ``CUT_MINOR`` (its heartbeat's ``"minor"``) before sending anything
(``WorkerTooOldError``, as ``score`` does).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

from align.rollout.message import _ID_RE, WorkerTooOldError, require_minor, worker_minor, worker_too_old
from align.rollout.protocol import (
    Completion,
    Message,
    ProtocolError,
    SamplingParams,
    _is_int,
    generate_request,
    new_id,
)

CUT_MINOR = 2


def too_old(root: object, minor: object) -> WorkerTooOldError:
    needs = "cutting requests in flight (partial rollouts) needs"
    return worker_too_old(root, minor, needs, CUT_MINOR, "run without partial rollouts")


def cut_problem(body: dict) -> str | None:
    """What is wrong with a cut request body, or None."""
    ids = body["requests"]
    if not ids or not all(isinstance(i, str) and _ID_RE.fullmatch(i) for i in ids):
        return f"'requests' must be a non-empty list of generate request ids, got {str(ids)[:80]}"
    if len(set(ids)) != len(ids):
        return "'requests' names a request twice"
    return None


def cut_request(request_ids: list[str], id: str | None = None) -> Message:
    msg = Message("cut", id or new_id("c"), {"requests": [str(i) for i in request_ids]})
    if (problem := cut_problem(msg.body)) is not None:
        raise ValueError(f"cut request {msg.id}: {problem}")
    return msg


def check_cut_done(body: dict, request: dict, source: str) -> dict[str, str]:
    """A ``cut_done`` answer as {request id: "cut" | "untouched"}, one entry per id the cut named."""
    named = request["requests"]
    got = {i: "cut" for i in body["cut"]} | {i: "untouched" for i in body["untouched"]}
    if sorted(got) != sorted(named) or len(body["cut"]) + len(body["untouched"]) != len(named):
        raise ProtocolError(f"{source}: cut_done names {sorted(got)[:5]}, not each of the cut's {named[:5]} once")
    return got


def check_worker(client: Any) -> None:
    """``WorkerTooOldError`` when the worker behind ``client`` announces a minor below ``CUT_MINOR``."""
    require_minor(client.spool.root, client.spool.read_heartbeat(), CUT_MINOR, too_old)


def cut_requests(client: Any, request_ids: list[str]) -> dict[str, str]:
    """Cut the generate requests ``request_ids`` on the worker behind ``client`` (an
    ``align.rollout.client.SpoolClient``); returns {id: "cut" | "untouched"} once their answers are published.
    ``WorkerTooOldError``, nothing sent, for a worker below ``CUT_MINOR``."""
    check_worker(client)
    msg = cut_request(request_ids)
    client.spool.submit(msg)
    out: dict[str, str] = {}

    def check(resp: Message, source: str) -> None:
        if resp.kind == "cut_done":
            out.update(check_cut_done(resp.body, msg.body, source))

    try:
        client.wait(msg.id, expect="cut_done", check=check)
    except RuntimeError as e:  # RolloutError: a worker that announced a minor it does not serve
        if "unknown message kind 'cut'" in str(e):
            raise too_old(client.spool.root, worker_minor(client.spool.read_heartbeat())) from None
        raise
    return out


def cut(client: Any, requests: dict[str, tuple[list[list[int]], SamplingParams]]) -> dict[str, list[Completion]]:
    """Cut generate requests in flight (``requests``: request id -> its prompts and params) and collect the
    completions of each one whose answer was not taken yet: rows still running have finish reason ``"cut"`` and
    their tokens and logprobs so far; a request answered before the cut comes back as it was answered (one already
    taken is left out). Continue a cut row with ``continuation_prompt``, join the answers with ``stitch``."""
    cut_requests(client, list(requests))
    out = {}
    for rid, (prompts, params) in requests.items():
        if client.spool.request_state(rid) == "answered":  # not taken yet (each cut one is answered by now)
            out[rid] = client.generate(prompts, params, request_id=rid)
    return out


def continuation_prompt(prompt: list[int], done: Completion, params: SamplingParams) -> tuple[list[int], int]:
    """The prompt and ``max_tokens`` that continue cut completion ``done`` of ``prompt`` under ``params``."""
    if done.finish_reason != "cut":
        raise ValueError(f"completion {done.prompt_index}/{done.sample_index} finished ({done.finish_reason}): no rest")
    left = params.max_tokens - len(done.token_ids)
    if left < 1:
        raise ValueError(f"a cut completion of {len(done.token_ids)} tokens has no room under {params.max_tokens}")
    return list(prompt) + list(done.token_ids), left


def stitch(done: Completion, rest: Completion) -> Completion:
    """``done`` (a cut completion) followed by ``rest`` (the answer to its continuation): one completion with the
    indices and first version of ``done``, the finish reason of ``rest``, and each token's version in
    ``token_versions`` (a segment without its own takes its answer's ``weights_version`` for every token; None when
    all tokens share one version, as the protocol reads None)."""
    if done.finish_reason != "cut":
        raise ValueError(f"stitch: the first segment finished with {done.finish_reason!r}, not 'cut'")
    if (done.sampled_logprobs is None) != (rest.sampled_logprobs is None):
        raise ValueError("stitch: one segment has sampled_logprobs and the other not (two logprob bases)")
    versions = [*versions_of(done), *versions_of(rest)]
    if any(b < a for a, b in itertools.pairwise(versions)):
        raise ValueError(f"stitch: the continuation's versions go back in time ({versions})")
    sampled = None if done.sampled_logprobs is None else done.sampled_logprobs + rest.sampled_logprobs
    first = versions[0] if versions else rest.weights_version
    joined = {"token_ids": done.token_ids + rest.token_ids, "logprobs": done.logprobs + rest.logprobs}
    joined.update(finish_reason=rest.finish_reason, sampled_logprobs=sampled, weights_version=first)
    uniform = all(v == first for v in versions)  # None: every token from weights_version (as without a cut)
    return dataclasses.replace(done, **joined, token_versions=None if uniform else versions, routes=None)


def versions_of(c: Completion) -> list[int]:
    """The weights version of each token of ``c`` (checked against its tokens)."""
    if c.token_versions is None:
        return [c.weights_version] * len(c.token_ids)
    if len(c.token_versions) != len(c.token_ids) or not all(_is_int(v) for v in c.token_versions):
        raise ValueError(f"token_versions has {len(c.token_versions)} entries for {len(c.token_ids)} tokens")
    return list(c.token_versions)


def generate_until(
    client: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    need: int,
    carried: list[Completion | None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[Completion]:
    """The spool's "generate until ``need`` groups are complete, return the rest cut" (``--partial-rollouts``; the
    native sampler's is ``align.rollout.partial.generate_until`` on the ``partial`` branch, same contract).

    ``prompts``: one per group, ``params.n`` rows each; ``carried``: per row (prompt-major) None (fresh) or its
    completion so far (a cut one resumes as prompt + its ids with the rest of ``max_tokens``; a finished one comes
    back unchanged). A fresh group is one request, seeded as the whole batch in one request would be
    (``first_prompt_index``); a resumed row is a request of its own (seed stream ``R + row``). Once ``need`` groups
    are complete (or ``stop()``, asked between polls: ``--partial-cut publish``) the requests still out are cut
    (``cut``). Returns one completion per row, finished or cut,
    stitched onto what was carried (``stitch``)."""
    n, R = params.n, len(prompts) * params.n
    carried = list(carried) if carried is not None else [None] * R
    if len(carried) != R:
        raise ValueError(f"carried has {len(carried)} rows, the call has {R} ({len(prompts)} prompts x n={n})")
    run = [r for r in range(R) if carried[r] is None or carried[r].finish_reason == "cut"]
    if len(prompts) - len({r // n for r in run}) >= need or not run:
        raise ValueError(f"{need} group(s) are complete already: no call")
    check_worker(client)  # before anything is sent: a worker that cannot cut would run every group to the end
    sent: dict[str, tuple[list[list[int]], SamplingParams, list[int]]] = {}  # request id -> (prompts, params, rows)
    for g in sorted({r // n for r in run}):
        rows = [r for r in run if r // n == g]
        if len(rows) == n and all(carried[r] is None for r in rows):
            requests = [([prompts[g]], params, g, rows)]
        else:
            requests = []
            for r in rows:
                so_far = carried[r] if carried[r] is not None else Completion(g, r % n, [], [], "cut", [])
                p, budget = continuation_prompt(prompts[g], so_far, params)
                requests.append(([p], dataclasses.replace(params, n=1, max_tokens=budget), R + r, [r]))
        for ps, p, first, rs in requests:
            msg = generate_request(ps, p, first_prompt_index=first)
            client.spool.submit(msg)
            sent[msg.id] = (ps, p, rs)
    out = list(carried)
    for r, c in _until_groups(client, sent, len(prompts) - len({r // n for r in run}), need, n, stop).items():
        c = dataclasses.replace(c, prompt_index=r // n, sample_index=r % n)
        out[r] = c if carried[r] is None else stitch(carried[r], c)
    return out


def _until_groups(
    client: Any, sent: dict, complete: int, need: int, n: int, stop: Callable[[], bool] | None = None
) -> dict[int, Completion]:
    """Take the answers of ``sent`` until ``need`` groups are complete (``complete`` already are), then cut the rest;
    {row: its new completion}. Bounded by ``client.timeout_s``; a dead worker raises (``SpoolClient``'s check)."""
    pending, got = dict(sent), {}
    todo = {}  # group -> its rows still to answer
    for _, _, rows in sent.values():
        for r in rows:
            todo.setdefault(r // n, set()).add(r)
    deadline, last_check = time.monotonic() + client.timeout_s, 0.0
    while pending and complete + sum(not rows for rows in todo.values()) < need and not (stop and stop()):
        answered = [rid for rid in pending if client.spool.request_state(rid) == "answered"]
        for rid in answered:
            ps, p, rows = pending.pop(rid)
            got.update(zip(rows, client.generate(ps, p, request_id=rid)))
            for r in rows:
                todo[r // n].discard(r)
        if answered:
            continue
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"{need} group(s) not complete within timeout_s={client.timeout_s:.0f}")
        if now - last_check >= 0.25:
            last_check = now
            client._check_alive(next(iter(pending)))  # WorkerDiedError with the worker's log tail
        time.sleep(client.poll_s)
    if pending:
        answers = cut(client, {rid: (ps, p) for rid, (ps, p, _) in pending.items()})
        for rid, comps in answers.items():
            got.update(zip(pending[rid][2], comps))
    return got


class SpoolCuts:
    """``SpoolClient``'s partial-rollout methods (a mixin): ``cut`` and ``generate_until`` above."""

    def cut(self, requests: dict[str, tuple[list[list[int]], SamplingParams]]) -> dict[str, list[Completion]]:
        return cut(self, requests)

    def generate_until(
        self, prompts: list[list[int]], params: SamplingParams, need: int, carried: list | None = None, stop=None
    ) -> list[Completion]:
        return generate_until(self, prompts, params, need, carried, stop)
