"""SFT rows -> token rows: ``Example(ids, mask)``, every target token marked, each row checked before the model loads.

Row formats (JSONL / Parquet, read by ``align.data.iter_rows``):

- ``{"messages": [...]}``: a chat. Every assistant turn is a target (``--train-on last``: only the last, which must
  be the conversation's last turn); system, user and tool turns are context. An optional ``tools`` list reaches the
  chat template.
- ``{"prompt": str | [messages], "completion": str}``: the completion is the assistant's answer to the prompt.

Rendering is token-in/token-out, as the environments render an episode (``align.chat.TurnRenderer``): the context
before the first assistant turn is ``first`` (the template with its generation prompt), each assistant turn is
``assistant`` (exactly the tokens the template gives the assistant, ending with its stop token: what a policy
samples), and the turns after it are ``suffix`` (the template's junction after the stop token, e.g. Qwen's "\\n",
on the context side). A plain-string prompt is encoded as ``align.data`` encodes one, its completion as text plus
the stop id. Every other column of a row reaches ``--reward`` (eval pass@k) as ``**fields``.

Expert iteration (``--from-verified GEN VERIF ...``): the generation records of ``pipeline_gen_verify`` (the Lean
driver) paired with their verification records by ``sample_id``; accepted samples are kept, at most
``--per-problem-k`` per problem with distinct proofs (``lean_code``, else ``completion_text``), in file order. The
prompt is the recorded ``prompt_ids`` and the target the sampled ``completion_ids``: never re-tokenized. The files
are read here with the standard library (core never imports ``extras/``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.chat import TurnRenderer
from align.data import InputError, iter_rows

CONTEXT_ROLES = ("system", "user", "tool", "ipython", "developer")
ROW_KEYS = ("messages", "prompt", "completion", "tools")  # the keys a row's rendering uses; the rest are fields


@dataclass
class Example:
    """One training row as tokens. ``mask[t]``: ``ids[t]`` is a target (its logprob given ``ids[:t]`` is learned).
    ``prompt`` is where the last target starts (the eval samples a completion after ``ids[:prompt]``); ``record``
    what the reward sees ({"prompt": text, **fields})."""

    ids: list[int]
    mask: list[bool]
    where: str
    prompt: int
    record: dict = field(default_factory=dict)


class Renderers:
    """One ``TurnRenderer`` per distinct ``tools`` list of the rows (each renderer caches its template probes)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok, self.by_tools = tokenizer, {}

    def get(self, tools: list | None) -> TurnRenderer:
        key = json.dumps(tools, sort_keys=True)
        if key not in self.by_tools:
            self.by_tools[key] = TurnRenderer(self.tok, tools=tools)
        return self.by_tools[key]


def _messages(value: Any, where: str, what: str) -> list[dict]:
    if not (
        isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    ):
        raise InputError(f"{where}: {what} must be a non-empty list of {{'role': ..., 'content': ...}} objects")
    return value


def render_row(row: dict, where: str, renderers: Renderers, train_on: str) -> Example:
    """One row as an ``Example`` (see the module docstring); InputError naming ``where`` for a row without a target."""
    tools = row.get("tools")
    r = renderers.get(tools)
    fields = {k: v for k, v in row.items() if k not in ROW_KEYS}
    try:
        if "messages" in row:
            return _render_chat(_messages(row["messages"], where, "'messages'"), where, r, train_on, fields)
        if "prompt" not in row or "completion" not in row:
            raise InputError(
                f"{where}: an SFT row needs 'messages' (a chat with assistant turns) or 'prompt' + "
                f"'completion'; this one has {sorted(row)}"
            )
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(completion, str) or not completion:
            raise InputError(
                f"{where}: 'completion' must be a non-empty string (the assistant's target), got "
                f"{json.dumps(completion)[:60]}"
            )
        if isinstance(prompt, list):
            chat = [*_messages(prompt, where, "a chat 'prompt'"), {"role": "assistant", "content": completion}]
            return _render_chat(chat, where, r, "last", fields)
        if not isinstance(prompt, str) or not prompt:
            raise InputError(f"{where}: 'prompt' must be a non-empty string or a list of chat messages")
        context, target = r.first(prompt), r.assistant(completion)
        return Example(
            context + target,
            [False] * len(context) + [True] * len(target),
            where,
            len(context),
            {"prompt": prompt, **fields},
        )
    except InputError as e:
        msg = str(e)
        raise InputError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def _render_chat(msgs: list[dict], where: str, r: TurnRenderer, train_on: str, fields: dict) -> Example:
    """A chat: ``first`` of the context before the first assistant turn, then ``assistant`` / ``suffix`` in turn."""
    roles = [m["role"] for m in msgs]
    if "assistant" not in roles:
        raise InputError(
            f"{where}: the row has no assistant turn, so nothing to learn (roles {roles}); SFT rows "
            "need at least one assistant message"
        )
    if train_on == "last" and roles[-1] != "assistant":
        raise InputError(
            f"{where}: --train-on last trains on the last turn, and this row's last turn is "
            f"{roles[-1]!r}, not the assistant's; end the row with its assistant turn or use "
            "--train-on all"
        )
    first = roles.index("assistant")
    if first == 0:
        raise InputError(
            f"{where}: the conversation opens with an assistant turn; it needs a context turn (system "
            "or user) before it"
        )
    last = len(roles) - 1 - roles[::-1].index("assistant")
    ids = r.first(msgs[:first])
    mask, prompt, pending = [False] * len(ids), len(ids), []
    for i in range(first, last + 1):
        m = msgs[i]
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if i > first:  # the context since the previous assistant turn (none: just the junction and generation prompt)
            ids += (s := r.suffix(pending))
            mask += [False] * len(s)
            pending = []
        target = r.assistant(m)
        prompt = len(ids)
        ids += target
        mask += [train_on == "all" or i == last] * len(target)
    text = r.tok.decode(ids[:prompt], skip_special_tokens=False)
    return Example(ids, mask, where, prompt, {"prompt": text, **fields})


def check_fits(ex: Example, config: dict) -> None:
    """The row fits the model's context and its ids the vocabulary (``config``: the model's config.json)."""
    context, vocab = config.get("max_position_embeddings"), config.get("vocab_size")
    if isinstance(context, int) and len(ex.ids) > context:
        raise InputError(
            f"{ex.where}: the row is {len(ex.ids)} tokens, over the model's context of {context}; shorten it or drop it"
        )
    if isinstance(vocab, int) and ex.ids and (max(ex.ids) >= vocab or min(ex.ids) < 0):
        raise InputError(
            f"{ex.where}: token id {max(ex.ids)} is outside the model's vocabulary ({vocab}); is the "
            "tokenizer the model's own?"
        )


def load_examples(
    path: str | None, rows: list | None, flag: str, renderers: Renderers, train_on: str, config: dict
) -> list[Example]:
    """The ``Example``s of a data file (or of ``rows`` from Python), each rendered and checked once."""
    items = ((f"{flag} row {i}", r) for i, r in enumerate(rows)) if rows is not None else iter_rows(path, flag)
    out = []
    for where, row in items:
        if not isinstance(row, dict):
            raise InputError(f"{where}: an SFT row must be a dict, got {type(row).__name__}")
        out.append(render_row(row, where, renderers, train_on))
        check_fits(out[-1], config)
    if not out:
        raise InputError(f"{flag}: no rows to train on")
    return out


# ------------------------------------------------------------------------------------------------ expert iteration


def _records(path: str, need: dict[str, type]) -> list[tuple[str, dict]]:
    """(file:line, record) of a Lean driver JSONL file; each record has the ``need`` fields with those types."""
    out = []
    for where, row in iter_rows(path, "--from-verified"):
        for key, tp in need.items():
            v = row.get(key)
            if not isinstance(v, tp) or isinstance(v, bool) != (tp is bool) or v in ("", []):
                raise InputError(
                    f"{where}: not a pipeline_gen_verify record: {key!r} is {json.dumps(v)[:60]}, "
                    f"expected a non-empty {tp.__name__}; pass GEN.jsonl VERIF.jsonl pairs"
                )
        out.append((where, row))
    return out


def _ids(v: list, where: str, key: str) -> list[int]:
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise InputError(f"{where}: {key!r} must be a list of token ids (ints)")
    return v


def verified_examples(paths: list[str], per_problem_k: int, config: dict) -> list[Example]:
    """The accepted samples of GEN VERIF pairs (see the module docstring); InputError when the files do not pair."""
    out, kept = [], {}
    for gen_path, verif_path in zip(paths[::2], paths[1::2]):
        gens = _records(gen_path, {"sample_id": str, "problem_id": str, "prompt_ids": list, "completion_ids": list})
        verifs = _records(verif_path, {"sample_id": str, "problem_id": str, "accepted": bool})
        by_id = {}
        for where, g in gens:
            if g["sample_id"] in by_id:
                raise InputError(f"{where}: sample_id {g['sample_id']!r} repeats {by_id[g['sample_id']][0]}")
            by_id[g["sample_id"]] = (where, g)
        verdict = {}
        for where, v in verifs:
            if v["sample_id"] not in by_id:
                raise InputError(
                    f"{where}: sample_id {v['sample_id']!r} is not in {gen_path}: {gen_path} and "
                    f"{verif_path} do not pair; pass each VERIF after the GEN file it verified"
                )
            gen_where, g = by_id[v["sample_id"]]
            if v["problem_id"] != g["problem_id"]:
                raise InputError(
                    f"{where}: sample_id {v['sample_id']!r} is problem {v['problem_id']!r} here and "
                    f"{g['problem_id']!r} at {gen_where}: the files do not pair"
                )
            if v["sample_id"] in verdict and verdict[v["sample_id"]] != v["accepted"]:
                raise InputError(f"{where}: sample_id {v['sample_id']!r} is verified twice with different verdicts")
            verdict[v["sample_id"]] = v["accepted"]
        unverified = [w for w, g in gens if g["sample_id"] not in verdict]
        if unverified:
            raise InputError(
                f"{unverified[0]}: this generation record (and {len(unverified) - 1} more) has no "
                f"verification record in {verif_path}: the files do not pair"
            )
        for where, g in gens:
            if not verdict[g["sample_id"]]:
                continue
            proof = g["lean_code"] if isinstance(g.get("lean_code"), str) else g.get("completion_text")
            proofs = kept.setdefault(g["problem_id"], set())
            if proof in proofs or (per_problem_k and len(proofs) >= per_problem_k):
                continue
            proofs.add(proof)
            prompt = _ids(g["prompt_ids"], where, "prompt_ids")
            completion = _ids(g["completion_ids"], where, "completion_ids")
            ex = Example(
                prompt + completion,
                [False] * len(prompt) + [True] * len(completion),
                where,
                len(prompt),
                {"prompt": "", "problem_id": g["problem_id"]},
            )
            check_fits(ex, config)
            out.append(ex)
    if not out:
        raise InputError(f"--from-verified {' '.join(paths)}: no accepted sample to train on")
    return out


def read_model_config(model_dir: str) -> dict:
    """The model's config.json (context and vocabulary), read before the model loads."""
    from align.errors import read_json

    if not Path(model_dir).is_dir():
        raise InputError(f"--model {model_dir}: no such directory")
    return read_json(Path(model_dir) / "config.json")
