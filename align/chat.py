"""The model's own tokenizer (``tokenizer.json``), its chat template rendered as transformers renders it, and the
token-in/token-out turns of a multi-turn episode (``TurnRenderer``).

Decisions:
- The tokenizer is the ``tokenizers`` package reading ``tokenizer.json``; the chat template is rendered by
  ``jinja2`` in the same sandboxed environment as transformers' ``apply_chat_template`` (trim_blocks,
  lstrip_blocks, ``raise_exception``, ``tojson``, ``strftime_now``, ``{% generation %}``) with the same
  variables: ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special tokens and every
  keyword the caller passes (``enable_thinking``, ``date_string``, ...), so the text is byte-equal to it. Both
  are the optional extra ``align[hf]``, imported inside the functions that need them.
- Templates are found as transformers finds them: ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``
  (named by file) replace tokenizer_config.json's ``chat_template`` (a string, or a list of ``{name, template}``);
  with several, a render with ``tools`` uses ``tool_use`` when there is one, else ``default``.
- Any failure of a template (its ``raise_exception``, a ``TypeError`` on list content, a bound) is an
  ``InputError`` naming the template; the data loader adds the row.
- ``decode`` follows current transformers: ``clean_up_tokenization_spaces`` is applied only to non-BPE models
  (WordPiece), unless the config forces it with ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output``.
- A rendered chat prompt is a ``ChatPrompt`` (a ``str``): it already holds the template's special tokens, so
  ``HFTokenizer.encode`` adds none to it, as ``apply_chat_template(tokenize=True)`` does; a plain string gets the
  tokenizer's special tokens (e.g. Llama-3's BOS), as ``tokenizer(text)`` does.
- A render is bounded in time and output (``RENDER_MAX_SECONDS``, ``RENDER_MAX_CHARS``).
- Stop tokens are the union of ``generation_config.json``'s ``eos_token_id`` and the tokenizer config's ``eos_token``.
- Turns (``TurnRenderer``): the next turn's prompt is the ids so far + the policy's sampled ids (ending with its stop
  token) + the environment's messages rendered as a suffix against a fixed synthetic prefix: the template's junction
  after the assistant's stop token (Qwen's ``\\n`` after ``<|im_end|>``), the messages, the next generation prompt.
  The history is never re-rendered; ``check_append_only`` compares the accumulated ids with the whole conversation
  rendered at once (equal for append-only templates such as Qwen2.5 and Llama-3; Qwen3 drops earlier ``<think>``).
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

from align.errors import InputError, need_extra, read_json, read_text

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
RENDER_MAX_SECONDS = 10.0  # one chat-template render (real templates take milliseconds)
RENDER_MAX_CHARS = 128 << 20  # one render's output, and any string / list a template builds on the way
CLEAN_UP_BPE_FLAG = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


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
            if operator == "*" and any(
                isinstance(a, int) and isinstance(b, (str, list, tuple)) and len(b) * a > RENDER_MAX_CHARS
                for a, b in ((left, right), (right, left))
            ):
                raise RenderBoundError(f"builds a sequence over {RENDER_MAX_CHARS} items")
            if operator == "**" and isinstance(right, int) and right > 4096:  # 10**10**10: a huge int
                raise RenderBoundError(f"raises to the power {right}")
            return super().call_binop(context, operator, left, right)

    return Bounded


class ChatTemplate:
    """A Hugging Face chat template rendered as ``apply_chat_template(..., tokenize=False)`` renders it.

    ``source`` is one template, or named templates ``{name: source}`` (picked per render as transformers picks
    them: ``tool_use`` when ``tools`` is given and it exists, else ``default``)."""

    def __init__(
        self,
        source: str | dict[str, str],
        special_tokens: dict[str, str] | None = None,
        name: str = "the chat template",
    ):
        need_extra("jinja2", "hf", "a chat template")
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
        self.sources = {"default": source} if isinstance(source, str) else dict(source)
        self.source, self.name, self.env = self.sources.get("default"), name, env
        self.special_tokens = dict(special_tokens or {})
        self.defaults: dict[str, Any] = {}  # variables of every render (--chat-template-kwargs); a render's own win
        self.templates = {key: self._compile(jinja2, src, self._label(key)) for key, src in self.sources.items()}

    def _label(self, key: str) -> str:
        return self.name if list(self.sources) == ["default"] else f"{self.name} (template {key!r})"

    def _compile(self, jinja2: Any, source: str, name: str) -> Any:
        if not isinstance(source, str):
            raise InputError(f"{name}: a chat template must be a string, got {type(source).__name__}")
        try:
            parsed = self.env.parse(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise InputError(f"{name}: line {e.lineno}: template syntax error: {e.message}") from None
        for node in parsed.find_all(
            (jinja2.nodes.Include, jinja2.nodes.Import, jinja2.nodes.FromImport, jinja2.nodes.Extends)
        ):
            raise InputError(
                f"{name}: line {node.lineno}: include / import / extends loads another template file; a chat "
                "template must be self-contained (paste the other template in)"
            )
        return self.env.from_string(parsed)

    def pick(self, tools: list[dict] | None = None) -> str:
        """The name of the template a render uses, as transformers' ``get_chat_template`` picks it."""
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        raise InputError(
            f"{self.name} has several chat templates {sorted(self.templates)} and none named 'default'; "
            "name one 'default' (chat_template.jinja)"
        )

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs: Any,
    ) -> ChatPrompt:
        """The text of ``messages``; ``kwargs`` reach the template as variables (``enable_thinking=False``, ...) and
        override the special tokens, as in ``apply_chat_template``. Any failure is an ``InputError`` naming it."""
        key = self.pick(tools)
        name = self._label(key)
        for what, items in (("tools", tools), ("documents", documents)):
            if items is not None and not (isinstance(items, list) and all(isinstance(t, dict) for t in items)):
                raise InputError(f"{name}: {what}= must be a list of JSON objects (dicts), got {items!r:.200}")
        self.env.deadline = time.monotonic() + RENDER_MAX_SECONDS
        variables = {
            **self.special_tokens,
            **self.defaults,
            **kwargs,
            "messages": messages,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            parts, size = [], 0
            for part in self.templates[key].generate(**variables):
                size += len(part)
                if size > RENDER_MAX_CHARS:
                    raise RenderBoundError(f"renders more than {RENDER_MAX_CHARS} characters")
                parts.append(part)
            text = "".join(parts)
        except RenderBoundError as e:
            raise InputError(
                f"{name}: the render was stopped: it {e}; a chat template must render within "
                f"{RENDER_MAX_SECONDS} s and {RENDER_MAX_CHARS} characters"
            ) from None
        except Exception as e:  # noqa: BLE001 -- the template is the user's code: any error it raises is named
            raise InputError(f"{name} failed on these messages ({type(e).__name__}: {e})") from None
        return ChatPrompt(text)


def load_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The templates of a tokenizer directory, found as transformers finds them: ``chat_template.jinja`` (named
    ``default``) and ``additional_chat_templates/NAME.jinja``, which replace tokenizer_config.json's
    ``chat_template`` (a string, or a list of ``{"name", "template"}``). None when there is none."""
    d = Path(directory)
    config = read_json(d / "tokenizer_config.json")
    files = [d / "chat_template.jinja"] if (d / "chat_template.jinja").is_file() else []
    if (d / "additional_chat_templates").is_dir():
        files += sorted((d / "additional_chat_templates").glob("*.jinja"))
    source: str | dict[str, str] | None = None
    if files:
        source = {
            ("default" if f == d / "chat_template.jinja" else f.name.removesuffix(".jinja")): read_text(
                f, "a chat template is UTF-8"
            )
            for f in files
        }
        name = str(files[0]) if len(files) == 1 else f"the chat templates in {d}"
    elif isinstance(config.get("chat_template"), str):
        source, name = config["chat_template"], f"the chat template in {d / 'tokenizer_config.json'}"
    elif isinstance(config.get("chat_template"), list):
        entries = config["chat_template"]
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in entries):
            raise InputError(
                f"{d / 'tokenizer_config.json'}: 'chat_template' must be a string or a list of "
                '{"name": ..., "template": ...} objects'
            )
        source, name = (
            {t["name"]: t.get("template") for t in entries},
            f"the chat templates in {d / 'tokenizer_config.json'}",
        )
    if not source:
        return None
    specials = {**read_json(d / "special_tokens_map.json"), **config}
    tokens = {k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_text(specials.get(k))) is not None}
    return ChatTemplate(source, tokens, name)


# ------------------------------------------------------------------------------------------------ tokenizer


def _clean_up_tokenization(s: str) -> str:  # transformers' clean_up_tokenization (WordPiece-era decoding)
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
        tokenizers = need_extra("tokenizers", "hf", f"the tokenizer in {d}")
        try:
            self.backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for a malformed file
            raise InputError(f"{d / 'tokenizer.json'}: not a tokenizers file ({e})") from None
        self.directory = d
        config = read_json(d / "tokenizer_config.json")
        # transformers applies clean_up_tokenization_spaces to non-BPE models only (it strips real spaces in BPE text)
        bpe = type(self.backend.model).__name__ == "BPE"
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            not bpe or bool(config.get(CLEAN_UP_BPE_FLAG, False))
        )
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
        eos = read_json(d / "generation_config.json").get("eos_token_id")
        out += [int(e) for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    token = _token_text(read_json(Path(directory) / "tokenizer_config.json").get("eos_token"))
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
        from align.char_tokenizer import CharTokenizer

        try:
            return CharTokenizer.load(d)
        except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError / JSONDecodeError are ValueErrors
            raise InputError(f"{d / 'align_tokenizer.json'}: not a char tokenizer ({type(e).__name__}: {e})") from None
    raise InputError(
        f"{flag} {d}: no tokenizer.json (a Hugging Face fast tokenizer); pass --tokenizer DIR "
        "pointing at the directory that holds the model's tokenizer.json"
    )


# ------------------------------------------------------------------------------------------------ turns

MARK = "ALIGN_TURN_MARK"  # the synthetic assistant message the suffix is cut at (plain letters: no template edits it)
PREFIX = ({"role": "user", "content": "ALIGN_TURN_USER"},)  # the fixed synthetic history before it


def _encode(tok: Any, text: str, special: bool) -> list[int]:
    """``text``'s ids, with the tokenizer's special tokens (BOS) only when ``special``; an ``HFTokenizer`` as
    ``align.data`` encodes (a ``ChatPrompt`` gets none), the char tokenizer through ``add_bos``."""
    if isinstance(tok, HFTokenizer):
        return tok.encode(text, add_special_tokens=special)
    own = "encode" in getattr(tok, "__dict__", {}) or not hasattr(type(tok), "encode")
    flag = _flag_of(tok.encode) if own else _class_flag(type(tok))
    return list(tok.encode(text, **{flag: special})) if flag else list(tok.encode(text))


def _flag_of(encode: Callable[..., Any]) -> str | None:
    """The keyword of ``encode`` that switches special tokens, if any."""
    params = inspect.signature(encode).parameters
    return next((f for f in ("add_special_tokens", "add_bos") if f in params), None)


@functools.lru_cache(maxsize=64)
def _class_flag(cls: type) -> str | None:
    return _flag_of(cls.encode)  # once per tokenizer class: inspect is slow (a render's encode paid it each time)


class TurnRenderer:
    """Token-in/token-out turns for one tokenizer: the first prompt, then each environment reply as a SUFFIX of the
    ids so far (never re-rendering the history from text)."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, template_kwargs: dict | None = None):
        self.tok, self.tools, self.kwargs = tokenizer, tools, dict(template_kwargs or {})
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, (str, dict)):  # a transformers tokenizer: its template source and special tokens
            template = ChatTemplate(template, dict(getattr(tokenizer, "special_tokens_map", {}) or {}))
        self.template: ChatTemplate | None = template
        self._end: tuple[str, str] | None = None  # (the stop-token text after MARK, the text from MARK to it)

    @property
    def name(self) -> str:
        return self.template.name if self.template is not None else "the tokenizer (no chat template)"

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> ChatPrompt:
        if self.template is None:
            raise InputError(
                f"{self.name}: chat messages need a chat template; give the tokenizer one or have the environment "
                "return plain strings"
            )
        return self.template.render(messages, add_generation_prompt, tools=self.tools, **self.kwargs)

    def _stop_texts(self) -> list[str]:
        stops = getattr(self.tok, "eos_token_id", None)
        ids = stops if isinstance(stops, (list, tuple)) else [stops] if isinstance(stops, int) else []
        return [t for i in ids if (t := self.tok.decode([i], skip_special_tokens=False))]

    def _assistant_end(self, text: str, mark_at: int, stop: str | None = None) -> int:
        """Where the assistant message at ``mark_at`` ends: right after the first stop-token text that follows
        MARK (``stop``, or any of the tokenizer's); -1 when none follows."""
        found = [(p, len(t)) for t in ([stop] if stop else self._stop_texts()) if (p := text.find(t, mark_at)) >= 0]
        return min(p + n for p, n in found) if found else -1

    def _end_of_mark(self) -> tuple[str, str]:
        if self._end is None:
            alone = self._render([*PREFIX, {"role": "assistant", "content": MARK}], add_generation_prompt=False)
            at = alone.find(MARK)
            cut = self._assistant_end(alone, at + len(MARK)) if at >= 0 else -1
            if cut < 0:
                raise InputError(
                    f"{self.name}: an assistant message does not end with one of the tokenizer's stop tokens "
                    f"{self._stop_texts()} in this template, so the environment's reply has no place to start; "
                    "check the tokenizer's eos_token / generation_config.json eos_token_id"
                )
            tail = alone[at:cut]
            self._end = (next(t for t in self._stop_texts() if tail.endswith(t)), tail)
        return self._end

    def first(self, obs: list[dict] | str) -> list[int]:
        """The first prompt's ids: messages rendered with add_generation_prompt=True (and tools=) then encoded as
        align.data encodes a chat prompt today; a str encoded exactly as align.data encodes a plain-text prompt."""
        if isinstance(obs, str):
            return list(self.tok.encode(obs))
        return _encode(self.tok, self._render(obs, add_generation_prompt=True), special=False)

    def suffix_text(self, obs: list[dict]) -> str:
        """The text of ``suffix(obs)``: what follows the assistant's stop token when ``obs`` answers it."""
        stop, tail = self._end_of_mark()
        both = self._render([*PREFIX, {"role": "assistant", "content": MARK}, *obs], add_generation_prompt=True)
        at = both.find(MARK)
        cut = self._assistant_end(both, at + len(MARK), stop) if at >= 0 else -1
        if cut < 0 or both[at:cut] != tail:
            raise InputError(
                f"{self.name} is not append-only at the assistant's end: an assistant message renders as "
                f"{tail!r} when it is last but not so when the environment's messages follow it"
            )
        return both[cut:]

    def suffix(self, obs: list[dict] | str) -> list[int]:
        """Ids to append after the policy's sampled ids (which end with the tokenizer's stop token): the template's
        junction tokens that the engine never samples (e.g. the "\\n" after Qwen's <|im_end|>), the environment's
        messages, and the next generation prompt. Rendered against a fixed synthetic prefix: render(prefix +
        [assistant MARK] + obs, add_generation_prompt=True), cut right after the stop-token text that follows MARK
        (the first of the tokenizer's stop tokens after MARK in render(prefix + [assistant MARK],
        add_generation_prompt=False)); the assistant's message from MARK to that stop must render the same in
        both, else InputError naming the template ("not append-only at the assistant's end"). Earlier history the
        template re-renders (Qwen3's dropped <think>) does not matter here: ``check_append_only`` reports it. A str
        obs: encoded as is (no template, no special tokens), for tokenizers without a chat template."""
        text = obs if isinstance(obs, str) else self.suffix_text(obs)
        return _encode(self.tok, text, special=False)

    def encode_text(self, text: str) -> list[int]:
        """``text``'s ids inside a message (no special token added: no BOS)."""
        return _encode(self.tok, text, special=False)

    def stop_id(self) -> int:
        """The id of the stop token that ends an assistant message in this template (the tokenizer's first stop id
        for a tokenizer without a template): the last id of ``assistant``."""
        stops = getattr(self.tok, "eos_token_id", None)
        ids = list(stops) if isinstance(stops, (list, tuple)) else [stops] if isinstance(stops, int) else []
        if self.template is not None:
            stop, _ = self._end_of_mark()
            ids = [i for i in ids if self.tok.decode([i], skip_special_tokens=False) == stop]
        if not ids:
            raise InputError(
                f"{self.name}: the tokenizer has no stop token (eos_token / generation_config.json "
                "eos_token_id), so an assistant target could never end; give it one"
            )
        return ids[0]

    def assistant(self, message: dict | str) -> list[int]:
        """The ids a policy trained on this template samples for the assistant ``message`` (a supervised target):
        the text the template puts between the generation prompt and the assistant's stop token, encoded, then the
        stop id, exactly as the engine returns a sampled turn (so ``first`` + ``assistant`` + ``suffix`` ... is the
        token-in/token-out conversation of an episode). Rendered against the fixed synthetic prefix, as ``suffix``:
        render(prefix, add_generation_prompt=True) must be a prefix of render(prefix + [message],
        add_generation_prompt=False), else InputError naming the template. A str: its text without a template (the
        plain-text prompts of a tokenizer without one), encoded as is, then the stop id."""
        if isinstance(message, str):
            return _encode(self.tok, message, special=False) + [self.stop_id()]
        stop, _ = self._end_of_mark()
        prompt = self._render(list(PREFIX), add_generation_prompt=True)
        both = self._render([*PREFIX, message], add_generation_prompt=False)
        cut = self._assistant_end(both, len(prompt), stop) if both.startswith(prompt) else -1
        if cut < 0:
            raise InputError(
                f"{self.name}: an assistant message does not render as the generation prompt followed by the "
                f"message and the stop token {stop!r}, so its target tokens cannot be told apart from the context"
            )
        return _encode(self.tok, both[len(prompt) : cut - len(stop)], special=False) + [self.stop_id()]

    def check_append_only(self, messages: list[dict], ids: list[int]) -> str | None:
        """The comparator: ids accumulated turn by turn vs the whole conversation (messages: the first messages, then
        assistant/env messages in order) rendered at once with the template and encoded. None when equal, else a
        one-line description of the first difference (position, the two token strings). The lead logs it ONCE per
        run as a warning naming the template.

        A conversation that ends with the assistant is rendered without a generation prompt and compared up to its
        last stop token (the junction after it belongs to the next turn)."""
        ends_with_policy = messages[-1].get("role") == "assistant"
        whole = self._render(messages, add_generation_prompt=not ends_with_policy)
        if ends_with_policy:
            stop, _ = self._end_of_mark()
            if (at := whole.rfind(stop)) >= 0:
                whole = ChatPrompt(whole[: at + len(stop)])
        want = _encode(self.tok, whole, special=False)
        if list(ids) == want:
            return None
        n = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))

        def show(seq: list[int]) -> str:
            return repr(self.tok.decode(list(seq[n : n + 8]), skip_special_tokens=False)) if n < len(seq) else "<end>"

        return (
            f"{self.name}: the turn-by-turn ids ({len(ids)}) differ from the conversation rendered at once "
            f"({len(want)}) at token {n}: {show(ids)} vs {show(want)}"
        )
