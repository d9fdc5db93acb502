"""Your own data: JSONL / Parquet rows, the model's own tokenizer (``tokenizer.json``) and its chat template.

A row is a JSON object (one per line) or a Parquet record. Its prompt is ``prompt`` (a string) or
``messages`` (a chat list ``[{"role": ..., "content": ...}, ...]``, rendered with the model's chat template
and ``add_generation_prompt=True``); ``--prompt-key`` names another column. Every other column reaches the
reward as a keyword argument: ``reward(prompt, completion, **fields)``.

Decisions:
- Everything a user can get wrong (missing file, a line that is not JSON, a row without its prompt, a
  prompt too long for ``--max-tokens``, a tokenizer directory without ``tokenizer.json``, a missing extra)
  raises ``InputError`` naming the file / line / flag and the fix, before the model is loaded.
- The tokenizer is the ``tokenizers`` package reading ``tokenizer.json`` and the chat template is rendered by
  ``jinja2`` in the same sandboxed environment as transformers' ``apply_chat_template`` (trim_blocks,
  lstrip_blocks, ``raise_exception``, ``tojson``, ``strftime_now``), so the text is byte-equal to it. Both are
  the optional extra ``align[hf]``, imported inside the functions that need them; the core stays on its
  four dependencies. Parquet needs ``pyarrow`` (``align[parquet]``).
- A rendered chat prompt is a ``ChatPrompt`` (a ``str``): it already holds the template's special tokens, so
  ``HFTokenizer.encode`` adds none to it, as ``apply_chat_template(tokenize=True)`` does; a plain ``prompt``
  string gets the tokenizer's special tokens (e.g. Llama-3's BOS), as ``tokenizer(text)`` does.
- Bounded work before any check: a JSONL line longer than ``MAX_LINE_BYTES`` is refused while reading (never
  read whole), a prompt longer than ``context * max_token_bytes`` bytes (the longest vocabulary entry, in
  UTF-8) is refused without tokenizing it (it cannot fit), and each row is read, rendered, tokenized and checked
  once, streamed; the ids travel on to the trainer (``load_task_data``). A chat template's render is bounded in
  time and output (``RENDER_MAX_SECONDS``, ``RENDER_MAX_CHARS``).
- Stop tokens are the union of ``generation_config.json``'s ``eos_token_id`` and the tokenizer config's
  ``eos_token``.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
RESERVED_FIELDS = ("prompt", "completion")  # the reward's positional parameters: no column may use these names
MAX_LINE_BYTES = 64 << 20  # one JSONL row; a longer line (or a file without newlines) is refused, never read whole
MAX_BYTES_PER_TOKEN = 64  # a tokenizer that does not say how many bytes its longest token covers
RENDER_MAX_SECONDS = 10.0  # one chat-template render (real templates take milliseconds)
RENDER_MAX_CHARS = 128 << 20  # one render's output, and any string / list a template builds on the way


class InputError(ValueError):
    """Bad user input (data file, tokenizer, reward spec, flags), found before the model is loaded."""


@dataclass
class DataConfig:
    train_data: str | None = field(
        default=None,
        metadata={
            "help": "Training prompts: a .jsonl or .parquet file (rows with 'prompt' or 'messages'); needs --reward."
        },
    )
    eval_data: str | None = field(
        default=None, metadata={"help": "Held-out prompts for eval, same format as --train-data."}
    )
    prompt_key: str = field(
        default="prompt",
        metadata={
            "help": "Column holding the prompt (a string, or a chat list like 'messages'); other columns reach the reward as **fields."
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "Directory with tokenizer.json (+ tokenizer_config.json / chat_template.jinja); default: the model dir."
        },
    )

    def __post_init__(self) -> None:
        if not self.prompt_key or self.prompt_key in ("completion",):
            raise ValueError(f"--prompt-key must name a prompt column, got {self.prompt_key!r}")


def _need(module: str, extra: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(
            f"{what} needs the optional package {module.split('.')[0]!r}: pip install 'align[{extra}]'"
        ) from None


# ------------------------------------------------------------------------------------------------ rows


def _utf8(raw: bytes, where: str, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}: not UTF-8 text (byte {raw[e.start : e.start + 1]!r} at column {e.start + 1}); {what}"
        ) from None


def read_text(path: Path, what: str) -> str:
    """A UTF-8 text file; a byte that is not UTF-8 is an ``InputError`` naming ``file:line``."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise InputError(f"{path}:{line}: not UTF-8 text (byte {raw[e.start : e.start + 1]!r}); {what}") from None


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


def _parquet_rows(path: Path, flag: str) -> list[tuple[str, dict]]:
    pq = _need("pyarrow.parquet", "parquet", f"{flag} {path} (Parquet)")
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError; re-raised with the flag and file named
        raise InputError(f"{flag} {path}: not a readable Parquet file ({e})") from None
    return [(f"{path}:row {i}", row) for i, row in enumerate(table.to_pylist())]


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


def to_record(row: dict, where: str, prompt_key: str, template: ChatTemplate | None) -> dict:
    """A row as a prompt record ``{"prompt": str, **fields}``; chat lists are rendered with ``template``."""
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
    return {"prompt": text, **fields}


# ------------------------------------------------------------------------------------------------ chat template


class ChatPrompt(str):
    """A prompt rendered by a chat template: it holds its special tokens already (``encode`` adds none)."""


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # an AddedToken as serialised by transformers: {"content": "<s>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


class RenderBoundError(Exception):
    """A chat-template render ran past ``RENDER_MAX_SECONDS`` or built more than ``RENDER_MAX_CHARS``."""


def _check_render(env: Any, *values: Any) -> None:
    if time.monotonic() > env.deadline:
        raise RenderBoundError(f"ran past {RENDER_MAX_SECONDS} s")
    if any(type(v) is int and v > RENDER_MAX_CHARS for v in values):  # 'x'.ljust(n), 'x'|center(n), ...
        raise RenderBoundError(f"asked for a size over {RENDER_MAX_CHARS}")


def _guarded(env: Any, f: Any) -> Any:
    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
    def g(*args: Any, **kwargs: Any) -> Any:
        _check_render(env, *args[1:], *kwargs.values())
        return f(*args, **kwargs)

    return g


class _Range:
    """``range`` for templates, checking the render's deadline as it is iterated (nested loops end in time)."""

    def __init__(self, env: Any, r: range) -> None:
        self.env, self.r = env, r

    def __len__(self) -> int:
        return len(self.r)

    def __getitem__(self, i: Any) -> Any:
        return self.r[i]

    def __iter__(self) -> Iterator[int]:
        for k, i in enumerate(self.r):
            if k % 256 == 0:
                _check_render(self.env)
            yield i

    def __reversed__(self) -> Iterator[int]:
        return iter(_Range(self.env, self.r[::-1]))


def _bounded_environment(jinja2: Any) -> type:
    """transformers' ``ImmutableSandboxedEnvironment``, bounded: every call, attribute, item, ``*`` / ``**`` /
    ``+`` and ``range`` step checks the render's deadline, and ``*`` refuses to build a string over the size."""

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+"])
        deadline = float("inf")

        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.globals["range"] = self.range = lambda *a: _Range(self, jinja2.sandbox.safe_range(*a))

        def call(self, context: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:  # range: the sandbox's own bound
            _check_render(self, *(() if obj is self.range else (*args, *kwargs.values())))
            return super().call(context, obj, *args, **kwargs)

        def getattr(self, obj: Any, attribute: str) -> Any:
            _check_render(self)
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _check_render(self)
            return super().getitem(obj, argument)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_render(self)
            if operator == "*" and any(isinstance(a, int) and isinstance(b, (str, list, tuple))
                                       and len(b) * a > RENDER_MAX_CHARS for a, b in ((left, right), (right, left))):  # fmt: skip
                raise RenderBoundError(f"builds a sequence over {RENDER_MAX_CHARS} items")
            if operator == "**" and isinstance(right, int) and right > 4096:  # 10**10**10: a huge int
                raise RenderBoundError(f"raises to the power {right}")
            return super().call_binop(context, operator, left, right)

    return Bounded


class ChatTemplate:
    """A Hugging Face chat template rendered as ``apply_chat_template(..., tokenize=False)`` renders it."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, name: str = "the chat template"):
        _need("jinja2", "hf", "a chat template")
        import jinja2
        import jinja2.ext
        import jinja2.sandbox

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(
            x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
        ) -> str:  # transformers' override: no HTML escaping
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        class Generation(jinja2.ext.Extension):  # {% generation %}...{% endgeneration %}: renders its body
            tags: ClassVar[set[str]] = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        env = _bounded_environment(jinja2)(
            trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.filters = {k: _guarded(env, f) for k, f in env.filters.items()}
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source, self.name = source, name
        self.special_tokens = dict(special_tokens or {})
        try:
            parsed = env.parse(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise InputError(f"{name}: line {e.lineno}: template syntax error: {e.message}") from None
        for node in parsed.find_all((jinja2.nodes.Include, jinja2.nodes.Import, jinja2.nodes.FromImport,
                                     jinja2.nodes.Extends)):  # fmt: skip
            raise InputError(
                f"{name}: line {node.lineno}: include / import / extends loads another template file; a chat "
                "template must be self-contained (paste the other template in)"
            )
        self.template, self.env = env.from_string(parsed), env

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> ChatPrompt:
        self.env.deadline = time.monotonic() + RENDER_MAX_SECONDS
        variables = {
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            parts, size = [], 0
            for part in self.template.generate(**variables, **{**self.special_tokens, **kwargs}):
                size += len(part)
                if size > RENDER_MAX_CHARS:
                    raise RenderBoundError(f"renders more than {RENDER_MAX_CHARS} characters")
                parts.append(part)
            text = "".join(parts)
        except RenderBoundError as e:
            raise InputError(
                f"{self.name}: the render was stopped: it {e}; a chat template must render within "
                f"{RENDER_MAX_SECONDS} s and {RENDER_MAX_CHARS} characters"
            ) from None
        except Exception as e:  # noqa: BLE001 -- the template is the user's code: any error it raises is named
            raise InputError(f"{self.name} failed on these messages ({type(e).__name__}: {e})") from None
        return ChatPrompt(text)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(read_text(path, "a tokenizer's JSON files are UTF-8"))
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def load_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The template of a tokenizer directory: ``chat_template.jinja``, else tokenizer_config's ``chat_template``
    (a string, or a list of named templates: the one named ``default``). None when there is none."""
    d = Path(directory)
    config = _read_json(d / "tokenizer_config.json")
    source, name = None, f"the chat template in {d / 'tokenizer_config.json'}"
    if (d / "chat_template.jinja").is_file():
        source, name = read_text(d / "chat_template.jinja", "a chat template is UTF-8"), f"{d / 'chat_template.jinja'}"
    elif isinstance(config.get("chat_template"), str):
        source = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):
        named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    specials = {**_read_json(d / "special_tokens_map.json"), **config}
    tokens = {k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_text(specials.get(k))) is not None}
    return ChatTemplate(source, tokens, name)


# ------------------------------------------------------------------------------------------------ tokenizer


def _clean_up_tokenization(s: str) -> str:  # transformers' clean_up_tokenization, for configs that ask for it
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        s = s.replace(a, b)
    return s


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``) through the ``tokenizers`` package.

    ``encode(text)`` adds the tokenizer's special tokens to a plain string (as ``tokenizer(text)``) and none to a
    ``ChatPrompt`` (as ``apply_chat_template``); ``decode`` skips special tokens by default (the reward sees
    the text). ``eos_token_id`` is the list of stop tokens; ``chat_template`` the directory's template or None."""

    def __init__(self, directory: str | Path, stop_ids: list[int] | None = None):
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise InputError(
                f"{d} has no tokenizer.json (a Hugging Face fast tokenizer); pass --tokenizer DIR "
                "pointing at the model's tokenizer files"
            )
        tokenizers = _need("tokenizers", "hf", f"the tokenizer in {d}")
        try:
            self.backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for a malformed file
            raise InputError(f"{d / 'tokenizer.json'}: not a tokenizers file ({e})") from None
        self.directory = d
        config = _read_json(d / "tokenizer_config.json")
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = load_chat_template(d)
        self.eos_token_id: list[int] = stop_ids if stop_ids is not None else stop_token_ids(d, self)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The UTF-8 length of the longest vocabulary entry: no token stands for more bytes of a prompt (byte-level
        markers like ``Ġ`` count 2, so this over-estimates)."""
        return max((len(t.encode("utf-8")) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = not isinstance(text, ChatPrompt)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_spaces else text

    def render_chat(self, messages: list[dict], **kwargs: Any) -> ChatPrompt:
        if self.chat_template is None:
            raise InputError(
                f"{self.directory} has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja)"
            )
        return self.chat_template.render(messages, **kwargs)


def stop_token_ids(directory: str | Path, tok: HFTokenizer, model_dir: str | Path | None = None) -> list[int]:
    """Stop tokens: ``eos_token_id`` of generation_config.json (model dir, then tokenizer dir) plus the tokenizer
    config's ``eos_token``, in that order, without repeats."""
    out: list[int] = []
    for d in [Path(p) for p in (model_dir, directory) if p is not None]:
        eos = _read_json(d / "generation_config.json").get("eos_token_id")
        out += [int(e) for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    token = _token_text(_read_json(Path(directory) / "tokenizer_config.json").get("eos_token"))
    if token is not None and (i := tok.token_to_id(token)) is not None:
        out.append(i)
    return list(dict.fromkeys(out))


def load_tokenizer(directory: str | Path, model_dir: str | Path | None = None, flag: str = "--tokenizer") -> Any:
    """``tokenizer.json`` -> ``HFTokenizer``; the built-in task's ``align_tokenizer.json`` -> ``CharTokenizer``."""
    d = Path(directory)
    if not d.is_dir():
        raise InputError(f"{flag} {d}: no such directory")
    if (d / "tokenizer.json").is_file():
        tok = HFTokenizer(d, stop_ids=[])
        tok.eos_token_id = stop_token_ids(d, tok, model_dir)
        return tok
    if (d / "align_tokenizer.json").is_file():
        from align.tasks.tokenizer import CharTokenizer

        try:
            return CharTokenizer.load(d)
        except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError / JSONDecodeError are ValueErrors
            raise InputError(f"{d / 'align_tokenizer.json'}: not a char tokenizer ({type(e).__name__}: {e})") from None
    raise InputError(
        f"{flag} {d}: no tokenizer.json (a Hugging Face fast tokenizer); pass --tokenizer DIR "
        "pointing at the directory that holds the model's tokenizer.json"
    )


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
    config = _read_json(Path(model_dir) / "config.json")
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
    config, template = _read_json(Path(model_dir) / "config.json"), getattr(tok, "chat_template", None)
    out: list[tuple[list[dict], list[list[int]]]] = []
    for path, flag in ((cfg.train_data, "--train-data"), (cfg.eval_data, "--eval-data")):
        records, ids = [], []
        for where, row in iter_rows(path, flag) if path is not None else ():
            records.append(to_record(row, where, cfg.prompt_key, template))
            ids.append(encode_prompt(tok, records[-1]["prompt"], where, config, max_tokens))
        out.append((records, ids))
    return tok, out[0][0], out[1][0], out[0][1], out[1][1]


def load_data(cfg: DataConfig, model_dir: str, max_tokens: int) -> tuple[Any, list[dict], list[dict]]:
    """(tokenizer, train records, eval records): ``load_task_data`` without the ids."""
    return load_task_data(cfg, model_dir, max_tokens)[:3]
