"""The rollout data contract and the spool's messages. stdlib only, by contract.

This module is imported by the vLLM rollout worker in its own venv (``.venv-rollout``),
so it must import with torch absent (``tests/test_dependency_firewall.py`` checks it).

``SamplingParams`` and ``Completion`` are the one definition shared by every rollout
backend (the native sampler and the spool/vLLM worker).

Logprob basis: ``Completion.logprobs[i]`` is ``log_softmax(logits / T)[token_i]`` over the
full vocabulary (the training basis, what the GRPO loss recomputes teacher-forced).
``Completion.sampled_logprobs[i]`` is the log-probability of token_i under the distribution
actually sampled from (after top-k / top-p renormalisation); it equals ``logprobs`` when
no truncation is active, and is ``None`` when the backend cannot provide it.
A backend that cannot produce the training basis says so in its ``logprob_basis``
(``LOGPROB_BASES``); ``logprob_basis_warning`` words the consequence for the trainer.

Messages: every message carries ``protocol``, ``version``, ``kind``, ``id``, ``created`` and a kind-specific
``body`` (``REQUEST_KINDS`` trainer -> worker, ``RESPONSE_KINDS`` back), and, on a spool, a ``mac``: HMAC-SHA256
of the spool's secret over the envelope and body (``message_mac``). A message with an unknown version, a missing
field or broken JSON raises ``ProtocolError`` naming its file; one without a valid MAC ``UntrustedMessageError``.
The response to request ``X`` has ``id`` = ``X``. The transport that carries them, one file per message in a spool
directory (after CPython's ``mailbox.Maildir``), is ``align/rollout/spool.py``; its public names are importable
from here too, so the worker needs this one import.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import json
import math
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.atomic import (  # noqa: F401
    COMMIT_MARKER,
    SNAPSHOT_MARKERS,
    atomic_write_text,
    check_hf_dir,
    check_private_dir,
    fsync_dir,
    private_secret,
    snapshot_marker,
)
from align.rollout.process import TORCHRUN_VARS, exit_with_parent, pid_alive, watch_parent, worker_env  # noqa: F401

# The spool's public names (align/rollout/spool.py, which imports this module) are importable from here too, looked
# up on first use (PEP 562): the worker's one import stays this module, and no import circle forms at load time.
_SPOOL_NAMES = ("Spool", "read_message", "heartbeat_problem", "AlreadyWaitingError", "HEARTBEAT_MAX_BYTES")


def __getattr__(name: str) -> object:
    if name in _SPOOL_NAMES:
        from align.rollout import spool

        return getattr(spool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PROTOCOL = "align-spool"
PROTOCOL_VERSION = 1
PROTOCOL_MINOR = 1  # minor versions only add request kinds (1: ``score``, align/rollout/scoring.py); heartbeat "minor"

# What Completion.logprobs holds, per backend:
#   "training":  log_softmax(logits / T) over the full vocabulary (native sampler; the GRPO basis)
#   "raw":       log_softmax(logits), temperature NOT applied (vLLM logprobs_mode=raw_logprobs);
#                equals "training" only at T == 1
#   "processed": log_softmax of the logits after temperature AND top-k/top-p masking
#                (vLLM logprobs_mode=processed_logprobs); equals "training" when no truncation is active
LOGPROB_BASES = ("training", "raw", "processed")

REQUEST_KINDS = ("generate", "sync_weights", "shutdown", "score")
RESPONSE_KINDS = ("completions", "synced", "error", "stopped", "scores")
# Required body fields and their JSON types, per kind. Extra fields are allowed (forward compatible).
_BODY_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "generate": {"prompts": (list,), "params": (dict,)},
    "sync_weights": {"path": (str,), "version": (int,)},
    "shutdown": {},
    "completions": {"completions": (list,), "weights_version": (int,), "logprob_basis": (str,), "timings": (dict,)},
    "synced": {"version": (int,), "seconds": (int, float), "method": (str,)},
    "error": {"error": (str,), "message": (str,)},
    "stopped": {},
    "score": {"sequences": (list,), "starts": (list,)},
    "scores": {"logprobs": (list,)},
}
_ID_RE = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")  # \Z: "$" would accept a trailing newline
FINISH_REASONS = ("stop", "length")
_counter = itertools.count()


class ProtocolError(ValueError):
    """A spool file that cannot be accepted (malformed, truncated, unknown version). Names the file."""


class UntrustedMessageError(ProtocolError):
    """A spool file not written by the spool's owner, or without a valid MAC of its secret: rejected, never answered."""


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        return cls(**d)


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]  # ends with the stop token when finish_reason == "stop"
    logprobs: list[float]  # training basis: log_softmax(logits / T) of each token
    finish_reason: str  # "stop" | "length"
    sampled_logprobs: list[float] | None = None  # under the truncated (top-k/top-p) distribution
    weights_version: int = 0
    # MoE, native sampler only (not on the wire): (len(token_ids) - 1, MoE layers, top-k) int16 expert ids of each
    # token fed back to the model (align.moe.batch_routes); None otherwise
    routes: Any = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(dataclasses.replace(self, routes=None))
        del d["routes"]  # routes stay in process (the spool does not carry them yet)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Completion:
        return cls(**d)


def logprob_basis_warning(basis: str, params: SamplingParams) -> str | None:
    """A warning for the trainer when ``basis`` differs from the training basis under ``params``; else None."""
    if basis not in LOGPROB_BASES:
        raise ValueError(f"unknown logprob basis {basis!r}; expected one of {LOGPROB_BASES}")
    truncated = params.top_p < 1.0 or params.top_k > 0
    if basis == "raw" and params.temperature not in (0.0, 1.0):
        return (
            f"the rollout backend returns raw logprobs (before temperature) but sampling uses "
            f"temperature={params.temperature}: old_logprobs differ from the training basis log_softmax(logits/T), "
            f"so rho will not be ~1 on-policy. Use temperature=1.0, or start the vLLM worker with "
            f"--logprobs-mode processed"
        )
    if basis == "processed" and truncated and params.temperature != 0.0:
        return (
            f"the rollout backend returns processed logprobs with top_p={params.top_p} top_k={params.top_k}: "
            f"they are under the truncated distribution, not the full-vocabulary training basis"
        )
    return None


# ---------------------------------------------------------------------------------------------
# Messages


def new_id(prefix: str = "r") -> str:
    """A unique message id that sorts by creation time (requests are served in file-name order)."""
    return f"{prefix}{time.time_ns():020d}-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:6]}"


@dataclass
class Message:
    """One spool message: an envelope (protocol, version, kind, id, created) around a kind-specific body."""

    kind: str
    id: str
    body: dict
    created: float = field(default_factory=time.time)
    version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if self.kind not in _BODY_FIELDS:
            raise ValueError(f"unknown message kind {self.kind!r}; expected one of {tuple(_BODY_FIELDS)}")
        if not isinstance(self.id, str) or not _ID_RE.fullmatch(self.id):
            raise ValueError(
                f"bad message id {self.id!r}: use 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
            )

    def to_json(self, secret: bytes | None = None) -> str:
        """The message as one JSON line; with ``secret`` (the spool's key) it carries its ``mac``."""
        d = {"protocol": PROTOCOL, "version": self.version, "kind": self.kind, "id": self.id, "created": self.created}
        d["body"] = self.body
        if secret is not None:
            d["mac"] = message_mac(secret, d)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, source: str = "<message>", secret: bytes | None = None) -> Message:
        """Parse and validate one message; any defect raises ProtocolError naming ``source``. With ``secret``, a
        missing or wrong ``mac`` raises UntrustedMessageError."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProtocolError(f"{source}: malformed or truncated spool message ({e}); rejected") from None
        if not isinstance(d, dict) or d.get("protocol") != PROTOCOL:
            raise ProtocolError(f"{source}: not an {PROTOCOL} message (protocol={_get(d, 'protocol')!r}); rejected")
        if d.get("version") != PROTOCOL_VERSION:
            raise ProtocolError(
                f"{source}: unsupported protocol version {d.get('version')!r} (this side speaks {PROTOCOL_VERSION}); "
                f"run the trainer and the worker from the same align checkout"
            )
        if secret is not None and not hmac.compare_digest(str(d.get("mac")).encode(), message_mac(secret, d).encode()):
            raise UntrustedMessageError(f"{source}: no valid MAC of the spool's secret (not its trainer's or worker's)")
        for key, typ in (("kind", str), ("id", str), ("created", (int, float)), ("body", dict)):
            if not isinstance(d.get(key), typ):
                raise ProtocolError(f"{source}: field {key!r} missing or of the wrong type ({d.get(key)!r}); rejected")
        kind, body = d["kind"], d["body"]
        if kind not in _BODY_FIELDS:
            raise ProtocolError(f"{source}: unknown message kind {kind!r}; rejected")
        for key, typ in _BODY_FIELDS[kind].items():
            if not isinstance(body.get(key), typ) or isinstance(body.get(key), bool):
                raise ProtocolError(f"{source}: {kind} body field {key!r} missing or wrong type ({body.get(key)!r})")
        try:
            msg = cls(kind=kind, id=d["id"], body=body, created=float(d["created"]))
        except ValueError as e:
            raise ProtocolError(f"{source}: {e}") from None
        if kind == "generate":
            _check_generate(body, source)
        return msg


def message_mac(key: bytes, d: dict) -> str:
    """HMAC-SHA256 of ``key`` over a message's envelope and body (canonical JSON: a parsed message gives the same)."""
    signed = {k: d.get(k) for k in ("protocol", "version", "kind", "id", "created", "body")}
    return hmac.new(key, json.dumps(signed, sort_keys=True, separators=(",", ":")).encode(), "sha256").hexdigest()


def _get(d: object, key: str) -> object:
    return d.get(key) if isinstance(d, dict) else None


def _check_generate(body: dict, source: str) -> None:
    prompts = body["prompts"]
    if not prompts or not all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompts):
        raise ProtocolError(f"{source}: generate 'prompts' must be a non-empty list of non-empty token-id lists")
    try:
        SamplingParams.from_dict(body["params"])
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{source}: bad generate 'params': {e}") from None
    first = body.get("first_prompt_index", 0)
    if not _is_int(first) or first < 0:
        raise ProtocolError(f"{source}: generate 'first_prompt_index' must be an int >= 0, got {first!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


LOGPROB_SLACK = 1e-3  # a log-probability above this is not one (fp32 rounding may leave a hair above 0)


def _is_logprob(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x) and x <= LOGPROB_SLACK


def check_completions(
    body: dict, prompts: list[list[int]], params: SamplingParams, source: str, vocab_size: int | None = None
) -> list[Completion]:
    """The completions of a ``completions`` response, checked against the request that asked for them.

    Exactly one completion per (prompt_index in [0, len(prompts)), sample_index in [0, params.n)); token ids
    are ints (not bool / float / str) in [0, vocab_size) when ``vocab_size`` is known; 1 <= len <= max_tokens;
    ``logprobs`` (and ``sampled_logprobs`` unless None) are one number <= 0 per token; finish_reason is
    'stop' | 'length'. Any defect raises ProtocolError naming ``source``. Returns them in (prompt, sample) order.
    """
    items = body["completions"]
    if body.get("logprob_basis") not in LOGPROB_BASES:
        raise ProtocolError(f"{source}: logprob_basis {body.get('logprob_basis')!r} is not one of {LOGPROB_BASES}")
    want = len(prompts) * params.n
    if len(items) != want:
        raise ProtocolError(
            f"{source}: {len(items)} completions for {len(prompts)} prompt(s) x n={params.n} = {want}; rejected"
        )
    seen: dict[tuple[int, int], int] = {}
    out = []
    for k, c in enumerate(items):
        problem = _completion_problem(c, len(prompts), params, vocab_size)
        if problem is None and (c["prompt_index"], c["sample_index"]) in seen:
            problem = (
                f"duplicates (prompt_index, sample_index) of completion {seen[c['prompt_index'], c['sample_index']]}"
            )
        if problem is not None:
            raise ProtocolError(f"{source}: completion {k}: {problem}; rejected")
        seen[c["prompt_index"], c["sample_index"]] = k
        sampled = c.get("sampled_logprobs")
        out.append(
            Completion(
                c["prompt_index"],
                c["sample_index"],
                list(c["token_ids"]),
                [float(x) for x in c["logprobs"]],
                c["finish_reason"],
                None if sampled is None else [float(x) for x in sampled],
                c["weights_version"],
            )
        )
    return sorted(out, key=lambda c: (c.prompt_index, c.sample_index))


def _completion_problem(c: object, n_prompts: int, params: SamplingParams, vocab_size: int | None) -> str | None:
    if not isinstance(c, dict):
        return f"not a JSON object ({type(c).__name__})"
    pi, si, ids = c.get("prompt_index"), c.get("sample_index"), c.get("token_ids")
    if not _is_int(pi) or not 0 <= pi < n_prompts:
        return f"prompt_index {pi!r} is not an int in [0, {n_prompts})"
    if not _is_int(si) or not 0 <= si < params.n:
        return f"sample_index {si!r} is not an int in [0, n={params.n})"
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        return f"token_ids must be a list of int token ids, got {str(ids)[:80]}"
    if not 1 <= len(ids) <= params.max_tokens:
        return f"{len(ids)} token ids, expected 1..max_tokens={params.max_tokens}"
    bad = [t for t in ids if t < 0 or (vocab_size and t >= vocab_size)]
    if bad:
        return f"token ids outside the vocabulary [0, {vocab_size or 'inf'}): {bad[:5]}"
    for key in ("logprobs", "sampled_logprobs"):
        v = c.get(key)
        if key == "sampled_logprobs" and v is None:
            continue
        if not isinstance(v, list) or len(v) != len(ids) or not all(_is_logprob(x) for x in v):
            return f"{key} must be {len(ids)} numbers <= 0 (one per token), got {str(v)[:80]}"
    if c.get("finish_reason") not in FINISH_REASONS:
        return f"finish_reason {c.get('finish_reason')!r} is not one of {FINISH_REASONS}"
    if not _is_int(c.get("weights_version")):
        return f"weights_version {c.get('weights_version')!r} is not an int"
    return None


def generate_request(
    prompts: list[list[int]], params: SamplingParams, id: str | None = None, first_prompt_index: int = 0
) -> Message:
    """A generate request: token-id prompts and sampling params (n per prompt and seed live in params).

    ``first_prompt_index``: the global index of ``prompts[0]`` in a larger batch split over several requests (one
    per torchrun rank); the worker seeds sample j of prompt i with (seed, first_prompt_index + i, j), so the split
    batch samples what the whole batch in one request samples. The answer's prompt_index stays local (from 0)."""
    body = {"prompts": [list(map(int, p)) for p in prompts], "params": params.to_dict()}
    if first_prompt_index:
        body["first_prompt_index"] = first_prompt_index
    msg = Message("generate", id or new_id(), body)
    _check_generate(body, f"generate request {msg.id}")
    return msg


def sync_request(path: str | os.PathLike, version: int, id: str | None = None) -> Message:
    """A weight-sync command: load the committed HF snapshot at ``path``; stamp later responses ``version``."""
    return Message("sync_weights", id or new_id(), {"path": str(Path(path).resolve()), "version": int(version)})


def shutdown_request(id: str | None = None) -> Message:
    return Message("shutdown", id or new_id(), {})


def error_response(request_id: str, error: str, message: str) -> Message:
    return Message("error", request_id, {"error": error, "message": message})
