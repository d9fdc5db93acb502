"""The ``score`` request of the spool protocol (minor version 1): a worker's logprobs of given token ids. stdlib only.

    request  score   {"sequences": [[id, ...], ...], "starts": [s, ...]}
    answer   scores  {"logprobs": [[lp, ...], ...]}    one list per sequence, len(sequence) - start numbers

``logprobs[k][j]`` is ``log_softmax(logits)[sequences[k][starts[k] + j]]`` given every token before it: the exact
logprob of each given token (not a top-k), at temperature 1 (vLLM's ``prompt_logprobs`` skip the sampling
processors). On-policy distillation scores a step's sequences (prompt + completion) from the first completion token
(``align.run.teacher``); the vLLM worker serves it with ``prompt_logprobs=1`` on a prompt of the given ids.

Versions: a worker announces its minor version in its heartbeat (``"minor"``; absent = 0). ``score`` refuses a
worker below ``SCORE_MINOR`` before sending anything, and an answer of an older worker that did not know the kind
(``malformed_request: unknown message kind 'score'``) is reported the same way: ``WorkerTooOldError``.
"""

from __future__ import annotations

from typing import Any

from align.rollout.message import (
    WorkerTooOldError,
    require_minor,
    worker_minor,
    worker_too_old,
)  # defined once, for score and cut
from align.rollout.protocol import Message, ProtocolError, _is_int, _is_logprob, new_id

SCORE_MINOR = 1


def too_old(root: object, minor: object) -> WorkerTooOldError:
    needs = "the score request (on-policy distillation's teacher logprobs) needs"
    return worker_too_old(root, minor, needs, SCORE_MINOR, "use the in-process teacher")


def score_problem(body: dict, vocab_size: int | None = None, max_len: int | None = None) -> str | None:
    """What is wrong with a score request body, or None."""
    seqs, starts = body["sequences"], body["starts"]
    if not seqs or len(seqs) != len(starts):
        return f"'sequences' ({len(seqs)}) and 'starts' ({len(starts)}) must be non-empty lists of the same length"
    for k, (s, first) in enumerate(zip(seqs, starts)):
        if not isinstance(s, list) or not all(_is_int(t) for t in s):
            return f"sequence {k} is not a list of int token ids"
        if not _is_int(first) or not 1 <= first < len(s):
            return f"sequence {k}: start {first!r} is not in [1, {len(s)}) (the first token has no context)"
        bad = [t for t in s if t < 0 or (vocab_size and t >= vocab_size)]
        if bad:
            return f"sequence {k} has token ids outside the vocabulary [0, {vocab_size or 'inf'}): {bad[:5]}"
        if max_len is not None and len(s) + 1 > max_len:
            return (
                f"sequence {k} has {len(s)} tokens; the worker's --max-model-len {max_len} holds at most {max_len - 1}"
            )
    return None


def score_request(sequences: list[list[int]], starts: list[int], id: str | None = None) -> Message:
    body = {"sequences": [list(map(int, s)) for s in sequences], "starts": [int(x) for x in starts]}
    msg = Message("score", id or new_id("s"), body)
    if (problem := score_problem(body)) is not None:
        raise ValueError(f"score request {msg.id}: {problem}")
    return msg


def check_logprobs_answer(body: dict, request: dict, source: str) -> list[list[float]]:
    """The logprobs of a ``scores`` answer: one list per requested sequence, one logprob <= 0 per scored token."""
    lps = body["logprobs"]
    if len(lps) != len(request["sequences"]):
        raise ProtocolError(f"{source}: {len(lps)} logprob lists for {len(request['sequences'])} sequences; rejected")
    for k, (lp, s, first) in enumerate(zip(lps, request["sequences"], request["starts"])):
        if not isinstance(lp, list) or len(lp) != len(s) - first or not all(_is_logprob(x) for x in lp):
            raise ProtocolError(f"{source}: sequence {k}: expected {len(s) - first} logprobs <= 0, got {str(lp)[:80]}")
    return [[float(x) for x in lp] for lp in lps]


def score(client: Any, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
    """Ask the worker behind ``client`` (an ``align.rollout.client.SpoolClient``) for the logprobs of
    ``sequences[k][starts[k]:]``; ``WorkerTooOldError`` for a worker below minor version ``SCORE_MINOR``."""
    from align.rollout.client import RolloutError

    require_minor(client.spool.root, client.spool.read_heartbeat(), SCORE_MINOR, too_old)
    msg = score_request(sequences, starts)
    client.spool.submit(msg)
    out: list[list[float]] = []

    def check(resp: Message, source: str) -> None:
        if resp.kind == "scores":
            out[:] = check_logprobs_answer(resp.body, msg.body, source)

    try:
        client.wait(msg.id, expect="scores", check=check)
    except RolloutError as e:
        if "unknown message kind 'score'" in str(e):  # a worker that announced a minor it does not serve
            raise too_old(client.spool.root, worker_minor(client.spool.read_heartbeat())) from None
        raise
    return out
