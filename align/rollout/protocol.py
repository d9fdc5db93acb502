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

Messages (``align/rollout/message.py``, its message names re-exported here): every message carries ``protocol``,
``version``, ``kind``, ``id``, ``created`` and a kind-specific ``body`` (``message.REQUEST_KINDS`` trainer -> worker,
``message.RESPONSE_KINDS`` back), and, on a spool, a ``mac``: HMAC-SHA256 of the spool's secret over the envelope and
body (``message_mac``). A message with an unknown version, a missing field or broken JSON raises ``ProtocolError``
naming its file; one without a valid MAC ``UntrustedMessageError``.
The response to request ``X`` has ``id`` = ``X``. The transport that carries them, one file per message in a spool
directory (after CPython's ``mailbox.Maildir``), is ``align/rollout/spool.py``; its public names are importable
from here too, so the worker needs this one import (the floors: ``message`` under ``spool`` under this module).
"""

from __future__ import annotations

import array
import base64
import binascii
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
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
from align.rollout.message import (  # noqa: F401
    PROTOCOL,
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    SamplingParams,
    UntrustedMessageError,
    WorkerTooOldError,
    _check_generate,
    _is_int,
    message_mac,
    new_id,
    require_minor,
    worker_minor,
    worker_too_old,
)
from align.rollout.process import TORCHRUN_VARS, exit_with_parent, pid_alive, watch_parent, worker_env  # noqa: F401
from align.rollout.spool import (  # noqa: F401 -- the transport's public names: the worker's one import is this module
    HEARTBEAT_MAX_BYTES,
    AlreadyWaitingError,
    Spool,
    heartbeat_problem,
    read_message,
)

# What Completion.logprobs holds, per backend:
#   "training":  log_softmax(logits / T) over the full vocabulary (native sampler; the GRPO basis)
#   "raw":       log_softmax(logits), temperature NOT applied (vLLM logprobs_mode=raw_logprobs);
#                equals "training" only at T == 1
#   "processed": log_softmax of the logits after temperature AND top-k/top-p masking
#                (vLLM logprobs_mode=processed_logprobs); equals "training" when no truncation is active
LOGPROB_BASES = ("training", "raw", "processed")

# "cut": stopped mid-way by partial rollouts (a cut request, align/rollout/cut.py); resumed later, never trained
FINISH_REASONS = ("stop", "length", "cut")


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]  # ends with the stop token when finish_reason == "stop"
    logprobs: list[float]  # training basis: log_softmax(logits / T) of each token
    finish_reason: str  # "stop" | "length" | "cut" (partial rollouts: resumed in a later call, never trained)
    sampled_logprobs: list[float] | None = None  # under the truncated (top-k/top-p) distribution
    weights_version: int = 0  # the version the first token was sampled with
    # partial rollouts (--partial-rollouts): the weights version that sampled each token (len(token_ids) entries),
    # non-decreasing; None when every token came from weights_version (the only case without partial rollouts)
    token_versions: list[int] | None = None
    # MoE: (len(token_ids) - 1, MoE layers, top-k) int16 expert ids of each token fed back to the model
    # (align.moe.batch_routes): a torch tensor from the native sampler, ``PackedRoutes`` off the wire; None otherwise
    routes: Any = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(dataclasses.replace(self, routes=None))
        d["routes"] = None if self.routes is None else encode_routes(self.routes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Completion:
        routes = d.get("routes")
        return cls(**{**d, "routes": None if routes is None else decode_routes(routes)})


# ----------------------------------------------------------------------------------------------- MoE routes (minor 4)

ROUTES_MINOR = 4  # the spool minor whose completions may carry routes; a worker below it is refused before sending
ROUTES_DTYPE = "int16"  # little-endian, C order (rows, MoE layers, top-k)


@dataclass(frozen=True)
class PackedRoutes:
    """Routes decoded off the wire, stdlib only: ``shape`` (rows, MoE layers, top-k) and the int16 values in C
    order (``array('h')``). ``align.moe.batch_routes`` turns it into a tensor."""

    shape: tuple[int, int, int]
    data: array.array

    def tolist(self) -> list:
        rows, layers, k = self.shape
        flat = self.data.tolist()
        return [[flat[(r * layers + j) * k : (r * layers + j + 1) * k] for j in range(layers)] for r in range(rows)]


def encode_routes(routes: Any) -> dict:
    """``{"shape": [rows, layers, k], "dtype": "int16", "data": base64}`` of a (rows, layers, k) integer array: a
    ``PackedRoutes``, a torch tensor or a numpy array (read through ``tolist``: no import of either here)."""
    if isinstance(routes, PackedRoutes):
        shape, data = list(routes.shape), routes.data
    else:
        shape = [int(n) for n in routes.shape]
        if len(shape) != 3:
            raise ValueError(f"routes must be (rows, MoE layers, top-k), got shape {tuple(shape)}")
        data = array.array("h", [e for row in routes.tolist() for layer in row for e in layer])
    if sys.byteorder == "big":
        data = array.array("h", data)
        data.byteswap()
    return {"shape": shape, "dtype": ROUTES_DTYPE, "data": base64.b64encode(data.tobytes()).decode("ascii")}


def decode_routes(d: object) -> PackedRoutes:
    """The ``PackedRoutes`` of ``encode_routes``'s dict; ValueError naming the defect (shape, dtype, length)."""
    if not isinstance(d, dict) or set(d) != {"shape", "dtype", "data"}:
        raise ValueError(f"routes must be an object with shape, dtype, data, got {str(d)[:80]}")
    shape, dtype, blob = d["shape"], d["dtype"], d["data"]
    if not isinstance(shape, list) or len(shape) != 3 or not all(_is_int(n) and n >= 0 for n in shape):
        raise ValueError(f"routes shape {shape!r} is not [rows, MoE layers, top-k] of ints >= 0")
    if dtype != ROUTES_DTYPE or not isinstance(blob, str):
        raise ValueError(f"routes dtype {dtype!r} / data {type(blob).__name__}: expected {ROUTES_DTYPE!r} and base64")
    try:
        raw = base64.b64decode(blob.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise ValueError(f"routes data is not base64 ({e})") from None
    want = shape[0] * shape[1] * shape[2]
    if len(raw) != 2 * want:
        raise ValueError(f"routes data holds {len(raw)} bytes, shape {shape} needs {2 * want} (int16): truncated")
    data = array.array("h", raw)
    if sys.byteorder == "big":
        data.byteswap()
    if want and min(data) < 0:
        raise ValueError(f"routes hold a negative expert id ({min(data)})")
    return PackedRoutes(tuple(shape), data)  # type: ignore[arg-type]


def routes_too_old(root: object, minor: object) -> WorkerTooOldError:
    return worker_too_old(root, minor, "--routing-replay rollout needs", ROUTES_MINOR, "use --rollout native")


def check_routes_minor(spool: Spool, needed: bool = True) -> None:
    """Before a generate request that needs routes (``--routing-replay rollout`` over a spool; nothing when not
    ``needed``): ``WorkerTooOldError`` for the spool's worker below ``ROUTES_MINOR`` (its heartbeat), and a
    ``ProtocolError`` for one not started to return routes or not announced yet."""
    if not needed:
        return
    hb = require_minor(
        spool.root,
        spool.read_heartbeat(),
        ROUTES_MINOR,
        routes_too_old,
        no_worker=ProtocolError,
        unknown=": routes unknown",
    )
    if not hb.get("routes"):
        raise ProtocolError(
            f"the worker on spool {spool.root} does not return MoE routes: start it with --return-routes (vLLM's "
            "enable_return_routed_experts, GPU builds only) or use --rollout native / --routing-replay off"
        )


def logprob_basis_warning(basis: str, params: SamplingParams) -> str | None:
    """A warning for the trainer when ``basis`` differs from the training basis under ``params``; else None."""
    if basis not in LOGPROB_BASES:
        raise ValueError(f"unknown logprob basis {basis!r}; expected one of {LOGPROB_BASES}")
    truncated = params.processed
    if basis == "raw" and params.temperature not in (0.0, 1.0):
        return (
            f"the rollout backend returns raw logprobs (before temperature) but sampling uses "
            f"temperature={params.temperature}: old_logprobs differ from the training basis log_softmax(logits/T), "
            f"so rho will not be ~1 on-policy. Use temperature=1.0, or start the vLLM worker with "
            f"--logprobs-mode processed"
        )
    if basis == "processed" and truncated and params.temperature != 0.0:
        return (
            f"the rollout backend returns processed logprobs with top_p={params.top_p} top_k={params.top_k} "
            f"min_p={params.min_p} repetition_penalty={params.repetition_penalty}: they are under the truncated or "
            "penalised distribution, not the full-vocabulary training basis"
        )
    return None


LOGPROB_SLACK = 1e-3  # a log-probability above this is not one (fp32 rounding may leave a hair above 0)


def _is_logprob(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x) and x <= LOGPROB_SLACK


def check_completions(
    body: dict,
    prompts: list[list[int]],
    params: SamplingParams,
    source: str,
    vocab_size: int | None = None,
    need_routes: bool = False,
) -> list[Completion]:
    """The completions of a ``completions`` response, checked against the request that asked for them.

    Exactly one completion per (prompt_index in [0, len(prompts)), sample_index in [0, params.n)); token ids
    are ints (not bool / float / str) in [0, vocab_size) when ``vocab_size`` is known; 1 <= len <= max_tokens (0 too for
    a row a ``cut`` request stopped); ``logprobs`` (and ``sampled_logprobs`` unless None) are one number <= 0 per
    token; finish_reason is 'stop' | 'length' | 'cut'; ``routes`` (minor 4), when present, decode to
    len(token_ids) - 1 rows, and every completion with tokens has them when ``need_routes``. Any defect raises
    ProtocolError naming ``source``. Returns them in (prompt, sample) order.
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
        if problem is None and need_routes and c.get("routes") is None and c["token_ids"]:
            problem = "carries no routes, and --routing-replay rollout needs them (a worker without --return-routes?)"
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
                routes=None if c.get("routes") is None else decode_routes(c["routes"]),
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
    least = 0 if c.get("finish_reason") == "cut" else 1  # a row cut before its first token has none
    if not least <= len(ids) <= params.max_tokens:
        return f"{len(ids)} token ids, expected {least}..max_tokens={params.max_tokens}"
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
    if c.get("routes") is not None:  # minor 4: one (MoE layers, top-k) row per token fed back to the model
        try:
            rows = decode_routes(c["routes"]).shape[0]
        except ValueError as e:
            return str(e)
        if rows != max(len(ids) - 1, 0):
            return (
                f"routes have {rows} rows for {len(ids)} tokens: expected {max(len(ids) - 1, 0)} (len(token_ids) - 1)"
            )
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
