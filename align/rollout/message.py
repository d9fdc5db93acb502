"""One spool message: the envelope (``protocol``, ``version``, ``kind``, ``id``, ``created``, and on a spool its
``mac``), the kinds and their body fields, and ``SamplingParams`` (what a ``generate`` body's ``params`` hold).
stdlib only, by contract (the vLLM worker's venv imports it through ``align.rollout.protocol``).

Below both the transport (``align.rollout.spool`` reads and writes these messages) and the data contract
(``align.rollout.protocol``, which re-exports every public name here: the worker's one import), so neither imports
the other in a circle. ``tests/test_protocol.py`` tests them.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import json
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

PROTOCOL = "align-spool"
PROTOCOL_VERSION = 1
# minor versions only add request kinds (1: ``score``, align/rollout/teacher_logprobs.py; 2: ``cut``,
# align/rollout/cut.py; 3: ``sleep`` / ``wake_up``, align/rollout/sleep_mode.py; 4: MoE routes on completions,
# ``Completion.routes`` base64-packed, align/rollout/protocol.py ``ROUTES_MINOR``); a worker announces its minor in its
# heartbeat ("minor"), and a minor includes every one below it
PROTOCOL_MINOR = 4

REQUEST_KINDS = ("generate", "sync_weights", "shutdown", "score", "cut")
RESPONSE_KINDS = ("completions", "synced", "error", "stopped", "scores", "cut_done")
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
    "cut": {"requests": (list,)},
    "cut_done": {"cut": (list,), "untouched": (list,)},
}
# minor 3: vLLM's sleep mode, ``sleep`` / ``wake_up`` (align/rollout/sleep_mode.py)
REQUEST_KINDS += ("sleep", "wake_up")
RESPONSE_KINDS += ("slept", "awake")
_BODY_FIELDS.update(sleep={"level": (int,)}, wake_up={}, slept={"level": (int,)}, awake={})
_ID_RE = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")  # \Z: "$" would accept a trailing newline
_counter = itertools.count()


class ProtocolError(ValueError):
    """A spool file that cannot be accepted (malformed, truncated, unknown version). Names the file."""


class UntrustedMessageError(ProtocolError):
    """A spool file not written by the spool's owner, or without a valid MAC of its secret: rejected, never answered."""


class WorkerTooOldError(RuntimeError):
    """The worker speaks an older minor version of the spool protocol than the request needs."""


def worker_too_old(root: object, minor: object, needs: str, needed: int, otherwise: str) -> WorkerTooOldError:
    """The error for the worker on spool ``root``, at ``minor``, below the ``needed`` minor of what ``needs`` says
    (``"the score request ... needs"``); the fix: restart the worker from this checkout, or ``otherwise``."""
    return WorkerTooOldError(
        f"the worker on spool {root} speaks {PROTOCOL} {PROTOCOL_VERSION}.{minor}; {needs} {PROTOCOL_VERSION}.{needed} "
        f"or newer: restart the worker from this align checkout (extras/vllm_rollout/rollout_worker.py), or {otherwise}"
    )


def require_minor(
    root: object,
    hb: dict | None,
    needed: int,
    too_old: Callable[[object, int], WorkerTooOldError],
    *,
    no_worker: type[Exception] = RuntimeError,
    unknown: str = "",
) -> dict:
    """The heartbeat ``hb`` (``spool.read_heartbeat()``) of the worker on spool ``root``, checked before a request
    that needs minor version ``needed`` is sent: none yet is ``no_worker`` ("no worker has announced itself ...", then
    ``unknown``), a lower minor is ``too_old(root, its minor)`` (the feature's ``worker_too_old``). Returns ``hb``."""
    if hb is None:
        raise no_worker(f"no worker has announced itself on spool {root} yet (no heartbeat.json){unknown}")
    if worker_minor(hb) < needed:
        raise too_old(root, worker_minor(hb))
    return hb


def worker_minor(hb: dict | None) -> int:
    """The minor protocol version a heartbeat announces (0 for a worker from before minor versions)."""
    minor = (hb or {}).get("minor", 0)
    return minor if _is_int(minor) else 0


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
    min_p: float = 0.0  # 0 = off; else drop tokens below min_p * the top token's probability (after temperature)
    repetition_penalty: float = (
        1.0  # 1 = off; a logit of a token already in the prompt or completion: / p if > 0, * p else
    )

    @property
    def processed(self) -> bool:
        """The sampled distribution differs from the training basis ``log_softmax(logits / T)``: truncated (top-k,
        top-p, min-p) or penalised (repetition)."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0 or self.repetition_penalty != 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1) (0 = off), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.temperature < float("inf"):  # nan too: it would sample from nan probabilities
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for key, off in (("min_p", 0.0), ("repetition_penalty", 1.0)):  # unset: a request an older worker reads
            if d[key] == off:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        return cls(**d)


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
