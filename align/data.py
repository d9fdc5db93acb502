"""Your own data: JSONL / Parquet rows, the model's own tokenizer (``tokenizer.json``) and its chat template.

A row is a JSON object (one per line) or a Parquet record. Its prompt is ``prompt`` (a string) or
``messages`` (a chat list ``[{"role": ..., "content": ...}, ...]``, rendered with the model's chat template
and ``add_generation_prompt=True``); ``--prompt-key`` names another column. Every other column reaches the
reward as a keyword argument: ``reward(prompt, completion, **fields)``.

Decisions:
- Everything a user can get wrong (missing file, a line that is not JSON, a row without its prompt, a
  prompt too long for ``--max-tokens``, a tokenizer directory without ``tokenizer.json``, a missing extra)
  raises ``InputError`` naming the file / line / flag and the fix, before the model is loaded.
- The tokenizer and the chat template (rendered as transformers renders it) live in ``align.chat`` and are
  re-exported here; both need the optional extra ``align[hf]``. Parquet needs ``pyarrow`` (``align[parquet]``).
- A rendered chat prompt is a ``ChatPrompt``: ``encode`` adds no special tokens to it (``apply_chat_template``),
  while a plain ``prompt`` string gets the tokenizer's (e.g. Llama-3's BOS), as ``tokenizer(text)`` does.
- Bounded work before any check: a JSONL line longer than ``MAX_LINE_BYTES`` is refused while reading (never
  read whole), a prompt longer than ``context * max_token_bytes`` bytes (the longest vocabulary entry, in
  UTF-8) is refused without tokenizing it (it cannot fit), and each row is read, rendered, tokenized and checked
  once, streamed; the ids travel on to the trainer (``load_task_data``). A chat template's render is bounded in
  time and output (``align.chat.RENDER_MAX_SECONDS``, ``RENDER_MAX_CHARS``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.chat import (  # noqa: F401 -- re-exported: align.data is where callers have always found them
    RENDER_MAX_CHARS,
    RENDER_MAX_SECONDS,
    ChatPrompt,
    ChatTemplate,
    HFTokenizer,
    TurnRenderer,
    load_chat_template,
    load_tokenizer,
    stop_token_ids,
)
from align.errors import InputError, need_extra, read_json
from align.options import flag

RESERVED_FIELDS = ("prompt", "completion")  # the reward's positional parameters: no column may use these names
MAX_LINE_BYTES = 64 << 20  # one JSONL row; a longer line (or a file without newlines) is refused, never read whole
MAX_BYTES_PER_TOKEN = 64  # a tokenizer that does not say how many bytes its longest token covers


@dataclass
class DataConfig:
    train_data: str | None = flag(
        None, "Training prompts: a .jsonl or .parquet file (rows with 'prompt' or 'messages'); needs --reward."
    )
    eval_data: str | None = flag(None, "Held-out prompts for eval, same format as --train-data.")
    prompt_key: str = flag(
        "prompt",
        "Column holding the prompt (a string, or a chat list like 'messages'); other columns reach the reward as **fields.",
    )
    chat_template_kwargs: dict = field(
        default_factory=dict,
        metadata={
            "help": "JSON object of chat template variables for every render, as apply_chat_template(**kwargs): '{\"enable_thinking\": false}'."
        },
    )
    answer_key: str = flag(
        "answer",
        "Column holding the reference answer; the built-in rewards read it as 'answer' (a 'solution' column is read when there is no 'answer'; GSM8K's '#### N' and a \\boxed{} in it are found).",
    )
    tokenizer: str | None = flag(
        None, "Directory with tokenizer.json (+ tokenizer_config.json / chat_template.jinja); default: the model dir."
    )

    def __post_init__(self) -> None:
        if not self.prompt_key or self.prompt_key in ("completion",):
            raise ValueError(f"--prompt-key must name a prompt column, got {self.prompt_key!r}")


# ------------------------------------------------------------------------------------------------ rows


def _utf8(raw: bytes, where: str, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}: not UTF-8 text (byte {raw[e.start : e.start + 1]!r} at column {e.start + 1}); {what}"
        ) from None


def iter_rows(path: str | Path, flag: str = "--train-data") -> Iterator[tuple[str, dict]]:
    """(where, row) from a .jsonl / .json (one object per line) or .parquet file, one at a time; ``where`` is
    ``file:line``. A file without rows is an ``InputError`` (raised when the iteration ends)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{flag} {path}: no such file")
    empty = True
    for item in _parquet_rows(path, flag) if path.suffix == ".parquet" else _jsonl_rows(path, flag):
        empty = False
        yield item
    if empty:
        raise InputError(f"{flag} {path}: the file has no rows")


def read_rows(path: str | Path, flag: str = "--train-data") -> list[tuple[str, dict]]:
    """[(where, row)]: ``iter_rows`` as a list."""
    return list(iter_rows(path, flag))


PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: a large file is streamed, never held whole as Python objects


def _parquet_rows(path: Path, flag: str) -> Iterator[tuple[str, dict]]:
    pq = need_extra("pyarrow.parquet", "parquet", f"{flag} {path} (Parquet)")
    i = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                yield f"{path}:row {i}", row
                i += 1
    except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError; re-raised with the flag and file named
        raise InputError(f"{flag} {path}: not a readable Parquet file ({e})") from None


def _jsonl_rows(path: Path, flag: str) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as fh:
        for n, raw in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:  # read no further: the line may have no end
                raise InputError(
                    f"{path}:{n}: the line is longer than {MAX_LINE_BYTES} bytes (or the file has no newlines); "
                    f"{flag} takes JSONL, one row per line"
                )
            line = _utf8(raw, f"{path}:{n}", f"{flag} takes UTF-8 JSONL")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(
                    f"{path}:{n}: not valid JSON ({e.msg}); {flag} takes JSONL (one JSON object per line) or .parquet"
                ) from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{n}: a JSONL row must be a JSON object, got {type(row).__name__}")
            yield f"{path}:{n}", row


def _check_messages(msgs: Any, where: str) -> list[dict]:
    if not (
        isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs)
    ):
        raise InputError(f"{where}: a chat prompt must be a non-empty list of {{'role': ..., 'content': ...}} objects")
    for i, m in enumerate(msgs):  # a string, or a list of content parts; null only beside tool_calls
        content = m.get("content", "")
        if not (isinstance(content, (str, list)) or (content is None and m.get("tool_calls"))):
            kind = "null" if content is None else type(content).__name__
            raise InputError(
                f"{where}: message {i} ({m['role']}) has {kind} content; a message's 'content' must be a string "
                "(or a list of content parts)"
            )
    return msgs


def to_record(
    row: dict, where: str, prompt_key: str, template: ChatTemplate | None, answer_key: str = "answer"
) -> dict:
    """A row as a prompt record ``{"prompt": str, **fields}``; chat lists are rendered with ``template``; the
    ``answer_key`` column is also the field ``answer`` (what the built-in rewards read)."""
    key = prompt_key if prompt_key in row else ("messages" if "messages" in row else None)
    if key is None:
        raise InputError(
            f"{where}: the row has no {prompt_key!r} (or 'messages') field; its fields are "
            f"{sorted(row)}; name the prompt column with --prompt-key"
        )
    value = row[key]
    if isinstance(value, list):
        if template is None:
            raise InputError(
                f"{where}: a chat prompt ({key!r} is a list of messages) needs a chat template, and "
                "the tokenizer has none (tokenizer_config.json 'chat_template' or chat_template.jinja); "
                "give the tokenizer one with --tokenizer DIR, or use a 'prompt' string"
            )
        try:
            text: str = template.render(_check_messages(value, where))
        except InputError as e:  # the template's error, with the row it failed on
            raise InputError(f"{where}: {e}") from None
        if not text:
            raise InputError(f"{where}: {template.name} renders these messages to an empty prompt")
    elif isinstance(value, str):
        text = value
        if not text:
            raise InputError(f"{where}: {key!r} is an empty string; a prompt needs at least one character")
    else:
        raise InputError(f"{where}: {key!r} must be a string or a list of chat messages, got {type(value).__name__}")
    fields = {k: v for k, v in row.items() if k != key}
    clash = [k for k in RESERVED_FIELDS if k in fields]
    if clash:
        raise InputError(
            f"{where}: column(s) {clash} clash with the reward's (prompt, completion) parameters; "
            "rename them in the data file"
        )
    if answer_key != "answer":
        if answer_key not in row:
            raise InputError(
                f"{where}: --answer-key {answer_key!r}: the row has no such column; its fields are {sorted(row)}"
            )
        fields["answer"] = row[answer_key]
    from align.reward_calls import CHAT_KEY  # the chat list itself, for TRL-shaped conversational rewards

    return {"prompt": text, **fields, **({CHAT_KEY: value} if isinstance(value, list) else {})}


# ------------------------------------------------------------------------------------------------ a task


def load_records(path: str | Path, tok: Any, prompt_key: str, flag: str) -> tuple[list[dict], list[str]]:
    """The prompt records of a data file and where each came from (``file:line``)."""
    template = getattr(tok, "chat_template", None)
    rows = read_rows(path, flag)
    return [to_record(row, where, prompt_key, template) for where, row in rows], [w for w, _ in rows]


def encode_prompt(tok: Any, text: str, where: str, config: dict, max_tokens: int) -> list[int]:
    """``text``'s ids, checked: it fits the model's context with ``max_tokens`` and its ids the vocabulary
    (``config``: the model's config.json). A prompt with more bytes than the context can hold is refused
    without tokenizing it."""
    context, vocab = config.get("max_position_embeddings"), config.get("vocab_size")
    per_token = getattr(tok, "max_token_bytes", MAX_BYTES_PER_TOKEN)
    bound = context * per_token if isinstance(context, int) else None
    if bound is not None and 4 * len(text) > bound and (size := len(text.encode("utf-8"))) > bound:  # <= 4 B/char
        raise InputError(
            f"{where}: the prompt is {size} bytes; no token of this tokenizer covers more than {per_token} "
            f"bytes, so it cannot fit the model's context of {context} tokens; shorten it"
        )
    ids = tok.encode(text)
    if not ids:
        raise InputError(f"{where}: the prompt encodes to no tokens; a prompt needs at least one")
    if context and len(ids) + max_tokens > context:
        raise InputError(
            f"{where}: the prompt is {len(ids)} tokens; with --max-tokens {max_tokens} it does not "
            f"fit the model's context of {context}; shorten it or lower --max-tokens"
        )
    if vocab and ids and max(ids) >= vocab:
        raise InputError(
            f"{where}: token id {max(ids)} is outside the model's vocabulary ({vocab}); is "
            "--tokenizer the model's own tokenizer?"
        )
    return ids


def check_prompt_lengths(
    tok: Any, records: list[dict], wheres: list[str], model_dir: str | Path, max_tokens: int
) -> list[list[int]]:
    """Each prompt + ``max_tokens`` fits the model's context and every token id its vocabulary (config.json);
    the prompts' ids."""
    config = read_json(Path(model_dir) / "config.json")
    return [encode_prompt(tok, rec["prompt"], where, config, max_tokens) for rec, where in zip(records, wheres)]


def load_task_data(
    cfg: DataConfig, model_dir: str, max_tokens: int
) -> tuple[Any, list[dict], list[dict], list[list[int]], list[list[int]]]:
    """(tokenizer, train records, eval records, train ids, eval ids) for ``--train-data`` / ``--eval-data``:
    each row read, rendered, tokenized and checked once, one at a time; raises ``InputError``."""
    if not cfg.train_data:
        raise InputError("no --train-data: pass a .jsonl or .parquet file of prompts")
    if not Path(model_dir).is_dir():
        raise InputError(f"--model {model_dir}: no such directory")
    tok = load_tokenizer(cfg.tokenizer or model_dir, model_dir, "--tokenizer" if cfg.tokenizer else "--model")
    config, template = read_json(Path(model_dir) / "config.json"), with_template_kwargs(tok, cfg.chat_template_kwargs)
    out: list[tuple[list[dict], list[list[int]]]] = []
    for path, option in ((cfg.train_data, "--train-data"), (cfg.eval_data, "--eval-data")):
        records, ids = [], []
        for where, row in iter_rows(path, option) if path is not None else ():
            records.append(to_record(row, where, cfg.prompt_key, template, cfg.answer_key))
            ids.append(encode_prompt(tok, records[-1]["prompt"], where, config, max_tokens))
        out.append((records, ids))
    return tok, out[0][0], out[1][0], out[0][1], out[1][1]


def with_template_kwargs(tok: Any, kwargs: dict) -> Any:
    """The tokenizer's chat template (None without one), rendering ``kwargs`` (``--chat-template-kwargs``) always."""
    template = getattr(tok, "chat_template", None)
    if template is not None and kwargs:
        template.defaults = dict(kwargs)
    elif kwargs:
        raise InputError(
            f"--chat-template-kwargs {json.dumps(kwargs)}: the tokenizer has no chat template to pass them to"
        )
    return template


def load_data(cfg: DataConfig, model_dir: str, max_tokens: int) -> tuple[Any, list[dict], list[dict]]:
    """(tokenizer, train records, eval records): ``load_task_data`` without the ids."""
    return load_task_data(cfg, model_dir, max_tokens)[:3]
