"""The rollout data contract and the spool file protocol. stdlib only, by contract.

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

Spool protocol (after CPython's ``mailbox.Maildir``): one JSON file per message.

    spool/tmp/          staging; a message is written here, fsync'ed, then ``os.replace``d
    spool/requests/     published requests (trainer -> worker), processed in file-name order
    spool/claimed/      a request the worker took, by ``os.rename`` (only one reader can win)
    spool/done/         requests whose response is published (kept: request ids stay unique)
    spool/responses/    published responses, named by the request id (worker -> trainer)
    spool/rejected/     malformed files, moved aside with the reason logged
    spool/heartbeat.json  the worker's liveness record, rewritten atomically every second
    spool/secret          the spool's key (0600, made with the spool): every message carries its HMAC

Trust: the spool is this user's (0700; one of another user's, or writable by group / others, is refused), and a
message is read only from a file of this user's whose ``mac`` (HMAC-SHA256 of the secret over the envelope and
body) checks; anything else is moved to rejected/, counted (``Spool.untrusted``) and never answered. A
``heartbeat.json`` of another user is ignored (read as no heartbeat), counted (``Spool.foreign_heartbeats``) and
warned about once per ``Spool``.

A message is never modified after it is published. Every message carries ``protocol``,
``version``, ``kind``, ``id``, ``created`` and a kind-specific ``body``; a file with an
unknown version, a missing field or broken JSON raises ``ProtocolError`` naming the file.
The response to request ``X`` is ``responses/X.json`` (``id`` = ``X``), so responses are
idempotent by request id: a worker restarted on the same spool moves its unfinished
``claimed/`` requests back to ``requests/`` and skips any whose response already exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hmac
import itertools
import json
import logging
import math
import os
import re
import socket
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# The worker's one import: the atomic-file and process helpers it uses are re-exported here (both stdlib only).
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

log = logging.getLogger(__name__)

PROTOCOL = "align-spool"
PROTOCOL_VERSION = 1
PROTOCOL_MINOR = 1  # minor versions only add request kinds (1: ``score``, align/rollout/scoring.py); heartbeat "minor"
HEARTBEAT_MAX_BYTES = 1 << 20  # a heartbeat is ~200 bytes; a bigger file is not one (e.g. a link to /dev/zero)

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
_SPOOL_DIRS = ("tmp", "requests", "claimed", "done", "responses", "rejected", "waiters")
FINISH_REASONS = ("stop", "length")
_counter = itertools.count()


class ProtocolError(ValueError):
    """A spool file that cannot be accepted (malformed, truncated, unknown version). Names the file."""


class UntrustedMessageError(ProtocolError):
    """A spool file not written by the spool's owner, or without a valid MAC of its secret: rejected, never answered."""


class AlreadyWaitingError(RuntimeError):
    """Another client already waits for this request id (only one can take its response)."""


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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
                c["prompt_index"], c["sample_index"], list(c["token_ids"]), [float(x) for x in c["logprobs"]],
                c["finish_reason"], None if sampled is None else [float(x) for x in sampled], c["weights_version"],
            )
        )  # fmt: skip
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


def read_message(path: str | os.PathLike) -> Message:
    """Read and validate one message file; ProtocolError names the file on any defect.

    Only a regular file is read: a directory, FIFO, socket or device named ``*.json`` is refused without
    blocking (opened ``O_NONBLOCK``, checked with ``fstat`` before any read)."""
    return Message.from_json(_read_text(path, path), source=str(path))


def _read_text(
    path: str | os.PathLike, source: str | os.PathLike, owner: int | None = None, max_bytes: int | None = None
) -> str:
    """The UTF-8 text of regular file ``path`` (of uid ``owner`` if given; at most ``max_bytes`` if given); anything
    else raises ProtocolError (UntrustedMessageError for another owner) naming ``source``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise ProtocolError(f"{source}: not a regular file ({e.strerror}); rejected") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ProtocolError(f"{source}: not a regular file ({_file_kind(st.st_mode)}); rejected")
        if owner is not None and st.st_uid != owner:
            raise UntrustedMessageError(f"{source}: written by uid {st.st_uid}, not the spool's owner uid {owner}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise ProtocolError(f"{source}: larger than {max_bytes} bytes; rejected")
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{source}: not UTF-8 text ({e}); rejected") from None


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a device or special file"


# ---------------------------------------------------------------------------------------------
# The spool


class Spool:
    """A spool directory: publish, claim, answer and read messages; the worker's heartbeat.

    Single worker per spool (the worker holds ``worker.lock``); any number of trainers may submit.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        for name in _SPOOL_DIRS:
            setattr(self, name, self.root / name)
        self.heartbeat_path = self.root / "heartbeat.json"
        self.lock_path = self.root / "worker.lock"
        self.secret_path = self.root / "secret"
        self._key: bytes | None = None
        self.untrusted = 0  # messages refused by ``read``: not the owner's, or no valid MAC
        self.foreign_heartbeats = 0  # heartbeat reads that found another user's file (ignored)

    @property
    def key(self) -> bytes:
        """The spool's secret (``secret``, 0600), made on first use."""
        if self._key is None:
            self._key = private_secret(self.secret_path)
        return self._key

    def ensure(self) -> Spool:
        """Create the spool folders (0700) and its secret; prove the directory is writable and private (this user's,
        not writable by group or others), or raise RuntimeError saying so."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_private_dir(self.root, "spool directory")
            for name in _SPOOL_DIRS:
                (self.root / name).mkdir(mode=0o700, exist_ok=True)
                check_private_dir(self.root / name, "spool directory")
            self._key = private_secret(self.secret_path)
            fd, probe = tempfile.mkstemp(prefix=".probe.", dir=self.root / "tmp")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise RuntimeError(
                f"spool directory {self.root} is not usable ({e.__class__.__name__}: {e}); "
                f"pass a writable directory on a local or shared filesystem"
            ) from None
        return self

    def _path(self, folder: str, msg_id: str) -> Path:
        return self.root / folder / f"{msg_id}.json"

    # -- trainer side ---------------------------------------------------------------------------
    def submit(self, msg: Message) -> Path:
        """Publish a request. A request id is used once: resubmitting a known id raises ValueError."""
        if msg.kind not in REQUEST_KINDS:
            raise ValueError(f"{msg.kind!r} is not a request kind {REQUEST_KINDS}")
        if self.request_state(msg.id) is not None:
            raise ValueError(f"request id {msg.id} already exists in spool {self.root} ({self.request_state(msg.id)})")
        target = self._path("requests", msg.id)
        atomic_write_text(target, msg.to_json(self.key), tmp_dir=self.root / "tmp")
        return target

    def read(self, path: str | os.PathLike, source: str | os.PathLike | None = None) -> Message:
        """Read message file ``path`` (named ``source`` in errors): a file of another uid, or one without a valid
        MAC of this spool's secret, raises UntrustedMessageError (the caller moves it aside: ``reject_untrusted``)."""
        text = _read_text(path, source or path, owner=os.getuid())
        return Message.from_json(text, source=str(source or path), secret=self.key)

    def reject_untrusted(self, path: Path, name: str | None = None) -> Path:
        """Move an untrusted file to rejected/ and count it (``untrusted``); it is never answered."""
        self.untrusted += 1
        return self.reject(path, name)

    def request_state(self, msg_id: str) -> str | None:
        """'answered' | 'done' | 'claimed' | 'pending', or None for an unknown id."""
        for state, folder in (
            ("answered", "responses"),
            ("done", "done"),
            ("claimed", "claimed"),
            ("pending", "requests"),
        ):
            if self._path(folder, msg_id).exists():
                return state
        return None

    def take_response(self, msg_id: str, check: Callable[[Message, str], None] | None = None) -> Message | None:
        """Claim (rename) and read the response to ``msg_id``, then delete it; None if not there yet.

        The response must be a response kind whose ``id`` is ``msg_id``; ``check(msg, source)`` may refuse it
        further (raising ProtocolError naming ``source``). A refused response is kept in rejected/; an untrusted one
        (``read``) is counted there and waited past (None: the worker's answer may still come)."""
        src = self._path("responses", msg_id)
        taken = self.root / "tmp" / f"{msg_id}.taken-{os.getpid()}-{uuid.uuid4().hex[:6]}.json"
        try:
            os.rename(src, taken)
        except FileNotFoundError:
            return None
        try:
            msg = self.read(taken, src)
            if msg.kind not in RESPONSE_KINDS:
                raise ProtocolError(f"{src}: a {msg.kind!r} message in responses/; rejected")
            if msg.id != msg_id:
                raise ProtocolError(f"{src}: the response's id {msg.id!r} is not the request id {msg_id!r}; rejected")
            if check is not None and msg.kind not in ("error", "stopped"):
                check(msg, str(src))
        except UntrustedMessageError:
            self.reject_untrusted(taken, name=f"{msg_id}.json")
            return None
        except ProtocolError:
            self.reject(taken, name=f"{msg_id}.json")
            raise
        os.unlink(taken)
        return msg

    @contextlib.contextmanager
    def waiting(self, msg_id: str) -> Iterator[None]:
        """Register this process as the one waiter for ``msg_id`` (a flock on waiters/<id>.lock, released at exit
        even on kill -9). A second waiter raises AlreadyWaitingError at once: only one can take the response."""
        path = self._path("waiters", msg_id).with_suffix(".lock")
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = ""
                for _ in range(50):  # the holder writes who it is just after taking the lock
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                    if holder:
                        break
                    time.sleep(0.01)
                os.close(fd)
                raise AlreadyWaitingError(
                    f"another client ({holder or 'unknown'}) is already waiting for request {msg_id} in {self.root}: "
                    f"only one can take its response; wait in that process or use a new request id"
                ) from None
            try:  # the holder unlinks the file before unlocking: a lock on an unlinked inode is no lock
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} thread {threading.get_ident()}".encode(), 0)
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)

    # -- worker side ----------------------------------------------------------------------------
    def pending(self) -> list[Path]:
        """Published requests in service order (file name = id, ids sort by creation time)."""
        return sorted(p for p in (self.root / "requests").iterdir() if p.suffix == ".json")

    def claim(self, path: Path) -> Path | None:
        """Take a request by rename into claimed/; None if another reader took it first."""
        dst = self.root / "claimed" / path.name
        try:
            os.rename(path, dst)
        except FileNotFoundError:
            return None
        return dst

    def respond(self, msg: Message) -> Path:
        """Publish the response to request ``msg.id``; an existing response is kept (idempotent by id)."""
        if msg.kind not in RESPONSE_KINDS:
            raise ValueError(f"{msg.kind!r} is not a response kind {RESPONSE_KINDS}")
        target = self._path("responses", msg.id)
        if not target.exists():
            atomic_write_text(target, msg.to_json(self.key), tmp_dir=self.root / "tmp")
        return target

    def finish(self, msg_id: str) -> None:
        """Move an answered request from claimed/ to done/."""
        with contextlib.suppress(FileNotFoundError):
            os.replace(self._path("claimed", msg_id), self._path("done", msg_id))

    def reject(self, path: Path, name: str | None = None) -> Path:
        """Move a malformed file (or a directory / FIFO named ``*.json``) aside: never half-read, never retried."""
        dst = self.root / "rejected" / (name or path.name)
        if dst.exists() or dst.is_symlink():
            dst = dst.with_name(f"{dst.stem}.{time.time_ns()}-{uuid.uuid4().hex[:6]}{dst.suffix}")
        os.rename(path, dst)
        return dst

    def recover(self) -> list[str]:
        """At worker start: requeue claimed-but-unanswered requests; finish the answered ones. Returns requeued ids."""
        requeued = []
        for path in sorted((self.root / "claimed").glob("*.json")):
            msg_id = path.stem
            if self._path("responses", msg_id).exists() or self._path("done", msg_id).exists():
                self.finish(msg_id)
            else:
                os.replace(path, self._path("requests", msg_id))
                requeued.append(msg_id)
        for stale in (self.root / "tmp").iterdir():  # half-written temp files of a dead writer
            if stale.name.startswith(".") and stale.name.endswith(".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
        return requeued

    # -- heartbeat ------------------------------------------------------------------------------
    def write_heartbeat(self, state: str, **info: object) -> None:
        """Rewrite heartbeat.json atomically: state is 'starting' | 'ready' | 'busy' | 'stopped' | 'failed'."""
        hb = {"protocol": PROTOCOL, "version": PROTOCOL_VERSION, "minor": PROTOCOL_MINOR, "kind": "heartbeat"}
        hb["state"] = state
        hb.update(pid=os.getpid(), host=socket.gethostname(), time=time.time(), **info)
        atomic_write_text(self.heartbeat_path, json.dumps(hb), tmp_dir=self.root / "tmp")

    def read_heartbeat(self) -> dict | None:
        """The last heartbeat, or None when the worker has not written one yet. Read as a message is (a FIFO,
        device or symlink is refused without blocking; a file of another user than the spool's owner is ignored:
        None, counted in ``foreign_heartbeats``, warned about once), and at most ``HEARTBEAT_MAX_BYTES``. Unlike a
        message it carries no MAC: it is rewritten every second and decides nothing but liveness."""
        try:
            text = _read_text(self.heartbeat_path, self.heartbeat_path, os.getuid(), HEARTBEAT_MAX_BYTES)
        except FileNotFoundError:
            return None
        except UntrustedMessageError as e:
            self.foreign_heartbeats += 1
            if self.foreign_heartbeats == 1:
                log.warning("%s; ignored (the spool's worker runs as this user; remove the file)", e)
            return None
        try:
            hb = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProtocolError(f"{self.heartbeat_path}: malformed heartbeat ({e})") from None
        if not isinstance(hb, dict) or hb.get("version") != PROTOCOL_VERSION or not isinstance(hb.get("time"), float):
            raise ProtocolError(f"{self.heartbeat_path}: unsupported heartbeat {str(hb)[:200]}")
        return hb


def heartbeat_problem(hb: dict | None, stale_s: float, now: float | None = None) -> str | None:
    """Why the worker behind heartbeat ``hb`` is not alive, or None if it looks alive (or has not started)."""
    if hb is None:
        return None
    if hb.get("state") in ("stopped", "failed"):
        err = hb.get("error")
        return f"worker (pid {hb.get('pid')}) is {hb['state']}" + (f": {err}" if err else "")
    if hb.get("host") == socket.gethostname() and not pid_alive(int(hb.get("pid", -1))):
        return f"worker process {hb.get('pid')} is gone (no clean shutdown recorded)"
    age = (time.time() if now is None else now) - hb["time"]
    if age > stale_s:
        return f"worker (pid {hb.get('pid')} on {hb.get('host')}) stopped heart-beating {age:.1f} s ago"
    return None
