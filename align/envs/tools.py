"""The built-in tool environment: the policy calls Python functions ("tools") and reads their results.

- ``tool_schema(fn)``: the OpenAI / Hugging Face function schema of ``fn`` from its type hints and its Google-style
  docstring, the same dict transformers' ``get_json_schema`` builds (the chat template's ``tools=`` takes a list of
  them); a signature that cannot be described is an ``InputError`` before anything loads.
- ``load_tools(specs, fns)``: tools from ``module:fn`` / ``path/file.py:fn`` specs (the name ``python`` is the
  built-in sandboxed python tool, ``align.envs.sandbox``) and from callables.
- ``parse_tool_calls(text)``: the calls in one assistant message, in the formats the supported chat templates teach:
  Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (any number per message) and
  Llama-3.1 JSON (the whole message is ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``).
- ``make_tool_env(tools, ...)``: an environment class (the ``align.envs`` API) whose ``step`` runs the calls and
  answers with one ``{"role": "tool"}`` message per call; the episode ends when the policy answers without a call,
  and the ``--reward`` functions score that final answer.

Failures never crash an episode: a malformed call, an unknown tool, arguments the function does not take, a tool
that raises or runs past its timeout each become an error tool message the policy reads, counted in
``info["tool_errors"]``. A user tool runs in a daemon thread with a timeout; a Python function cannot be killed, so
one past its timeout is abandoned (it may go on running in the background). The python tool runs in a subprocess
that is killed.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import re
import threading
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from align.envs import EnvError, Step
from align.envs.sandbox import PythonLimits, python, run_python
from align.errors import InputError
from align.reward_calls import settle

__all__ = ["Tool", "load_tools", "make_tool_env", "parse_tool_calls", "tool_schema"]

FLAG = "--tools"

# ------------------------------------------------------------------------------------------------ schemas

_BASIC = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_DESCRIPTION_RE = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS_RE = re.compile(r"\n\s*Args:\n\s*(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG_SPLIT_RE = re.compile(r"(?:^|\n)\s*(\w+):\s*(.*?)\s*(?=\n\s*\w+:|\Z)", re.DOTALL)
_RETURNS_RE = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES_RE = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def _json_type(hint: Any, where: str) -> dict:
    """The JSON schema of one type hint, as transformers' ``_parse_type_hint`` writes it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return {}
    if origin is None:
        if hint in _BASIC:
            return {"type": _BASIC[hint]}
        if hint in (list, tuple):
            return {"type": "array"}
        if hint is dict:
            return {"type": "object"}
        raise ValueError(f"{where} has the type {hint!r}, which has no JSON schema")
    if origin is typing.Union or origin is types.UnionType:
        subs = [_json_type(t, where) for t in args if t is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subs):
            names = sorted({s["type"] for s in subs})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subs}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal:
        if not all(type(a) in _BASIC for a in args):
            raise ValueError(f"{where}: a Literal may hold only str, int, float, bool or None values")
        kinds = list(dict.fromkeys(_BASIC[type(a)] for a in args))
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin is list:
        return {"type": "array", "items": _json_type(args[0], where)} if args else {"type": "array"}
    if origin is tuple and len(args) > 1 and ... not in args:
        return {"type": "array", "prefixItems": [_json_type(t, where) for t in args]}
    if origin is dict:
        return (
            {"type": "object", "additionalProperties": _json_type(args[1], where)}
            if len(args) == 2
            else {"type": "object"}
        )
    raise ValueError(f"{where} has the type {hint!r}, which has no JSON schema (use list[...] for a sequence)")


def _docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(description, {argument: description}, returns) of a Google-style docstring."""
    description = m.group(1).strip() if (m := _DESCRIPTION_RE.search(doc)) else ""
    args_block = m.group(1).strip() if (m := _ARGS_RE.search(doc)) else ""
    args_block = "\n".join(line for line in args_block.split("\n") if line.strip())
    args = {name: re.sub(r"\s*\n+\s*", " ", text.strip()) for name, text in _ARG_SPLIT_RE.findall(args_block)}
    returns = m.group(1).strip() if (m := _RETURNS_RE.search(doc)) else None
    return description, args, returns


def tool_schema(fn: Callable[..., Any]) -> dict:
    """``{"type": "function", "function": {"name", "description", "parameters", ["return"]}}`` for ``fn``.

    The description is the docstring's first paragraph, each parameter's text comes from its ``Args:`` section
    (a trailing ``(choices: [...])`` becomes an ``enum``), its type from the hint; a parameter without a default
    is required. ``InputError`` naming the function and ``--tools`` when a parameter has no type hint or an
    unsupported one, is ``*args`` / ``**kwargs``, or has no description, or the docstring has none. One
    deliberate difference from transformers: a hint of another class is refused (transformers calls it an object).
    """
    name = getattr(fn, "__name__", None) or type(fn).__name__

    def fail(why: str, fix: str) -> InputError:
        return InputError(f"{FLAG}: function {name}() cannot be described to the model: {why}; {fix}")

    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        raise fail("it has no docstring", "add one: a description, then an Args: section with a line per parameter")
    description, arg_docs, returns_doc = _docstring(doc.strip())
    if not description:
        raise fail("its docstring has no description before Args:", "start the docstring with what the tool does")
    try:
        sig, hints = inspect.signature(fn), typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as e:
        raise fail(
            f"its signature cannot be read ({type(e).__name__}: {e})", "use a plain def with type hints"
        ) from None
    properties: dict[str, dict] = {}
    required = []
    for pname, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise fail(f"*{pname} / **{pname} cannot be passed as JSON arguments", "name every parameter")
        if pname not in hints:
            raise fail(f"parameter {pname!r} has no type hint", f"annotate it ({pname}: str, int, list[int], ...)")
        if pname not in arg_docs:
            raise fail(f"its docstring's Args: section does not describe {pname!r}", f"add a line '{pname}: ...'")
        try:
            prop = _json_type(hints[pname], f"parameter {pname!r}")
        except ValueError as e:
            raise fail(
                str(e), "use str, int, float, bool, list[...], dict[str, ...], Literal[...] or X | None"
            ) from None
        text = arg_docs[pname]
        if choices := _CHOICES_RE.search(text):
            prop["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = text[: choices.start()].strip()
        prop["description"] = text
        properties[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        try:
            out["return"] = _json_type(hints["return"], "the return value")
        except ValueError as e:
            raise fail(str(e), "annotate the return value with a JSON type (str) or leave it out") from None
        if returns_doc is not None:
            out["return"]["description"] = returns_doc
    return {"type": "function", "function": out}


# ------------------------------------------------------------------------------------------------ loading


@dataclass(frozen=True)
class Tool:
    """A callable the policy may call by ``name``, described to it by ``schema``."""

    name: str
    fn: Callable[..., Any]
    schema: dict
    spec: str | None = None  # where it came from: 'python', 'module:fn', 'path/file.py:fn'; None = a callable


def load_tools(specs: list[str] | None = None, fns: list | None = None) -> list[Tool]:
    """Tools from ``--tools`` specs (``module:fn``, ``path/file.py:fn``, or ``python``, the built-in) and from
    callables (``tools=[fn]`` in Python); every schema is built here, so a bad one fails before the model loads.
    ``InputError`` on two tools with one name."""
    from align.rewards import load_spec

    out = []
    for spec in specs or []:
        fn = python if spec == "python" else load_spec(spec, flag=FLAG, kind="function")
        out.append(Tool(getattr(fn, "__name__", spec), fn, tool_schema(fn), spec))
    for fn in fns or []:
        if not callable(fn):
            raise InputError(f"tools=[...]: {fn!r} is a {type(fn).__name__}, not a function")
        out.append(Tool(getattr(fn, "__name__", type(fn).__name__), fn, tool_schema(fn)))
    seen: dict[str, Tool] = {}
    for tool in out:
        if tool.name in seen:
            raise InputError(
                f"{FLAG}: two tools are named {tool.name!r} ({seen[tool.name].spec or 'a callable'} and "
                f"{tool.spec or 'a callable'}); the model calls a tool by its name, so each needs its own"
            )
        seen[tool.name] = tool
    return out


# ------------------------------------------------------------------------------------------------ parsing

_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_LLAMA_END = ("<|eom_id|>", "<|eot_id|>")
_LLAMA_START_RE = re.compile(r'\A\{\s*"(name|parameters)"\s*:')


MAX_CALL_DEPTH = 64  # nesting of a call's JSON; deeper would recurse past Python's limit wherever it is re-read


def _depth(obj: Any) -> int:
    """How deeply lists / dicts nest in ``obj`` (0 for a scalar; counted up to MAX_CALL_DEPTH + 1), no recursion."""
    depth, level = 0, [obj]
    while depth <= MAX_CALL_DEPTH:
        level = [v for x in level if isinstance(x, (list, dict)) for v in (x.values() if isinstance(x, dict) else x)]
        if not level:
            break
        depth += 1
    return depth


def _load(body: str) -> tuple[Any, str | None]:
    """(a call's JSON, None) or (None, why it cannot be run): json.loads's own errors, JSON nested past Python's
    recursion limit (RecursionError) or past MAX_CALL_DEPTH, an integer past int's digit limit (ValueError), an
    escaped lone surrogate (no text: UnicodeEncodeError wherever it is written)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e})"
    except RecursionError:
        return None, "the tool call's JSON nests too deeply to read"
    except ValueError as e:
        return None, f"the tool call cannot be read ({e})"
    if _depth(obj) > MAX_CALL_DEPTH:
        return None, f"the tool call's JSON nests more than {MAX_CALL_DEPTH} levels deep"
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return None, f"the tool call holds {e.object[e.start : e.end]!r}, a lone surrogate, which is not text"
    return obj, None


def _call(body: str, args_keys: tuple[str, ...]) -> dict:
    """One call's JSON text -> ``{"name", "arguments"}`` or ``{"error", "text"}``."""
    obj, why = _load(body)
    if why:
        return {"error": why, "text": body}
    if not isinstance(obj, dict):
        return {"error": f"the tool call must be a JSON object, got a {type(obj).__name__}", "text": body}
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return {"error": 'the tool call has no "name" (a string naming the tool)', "text": body}
    key = next((k for k in args_keys if k in obj), None)
    args = obj[key] if key else {}
    if not isinstance(args, dict):
        return {
            "error": f'"{key}" must be a JSON object of named arguments, got a {type(args).__name__}',
            "name": name,
            "text": body,
        }
    return {"name": name, "arguments": args}


def parse_tool_calls(text: str) -> list[dict]:
    """The tool calls in one assistant message, in order: each ``{"name", "arguments"}`` or, for a call that
    cannot be read, ``{"error", "text"}`` (plus ``"name"`` when it has one). [] = no call (a final answer).

    Hermes / Qwen: each ``<tool_call>...</tool_call>`` block (an unclosed last one counts: generation may stop
    at its end) holds ``{"name": ..., "arguments": {...}}``. Llama-3.1: the whole message, after an optional
    ``<|python_tag|>``, is ``{"name": ..., "parameters": {...}}``; without the tag, only a message that begins
    ``{"name":`` or ``{"parameters":`` is a call (another JSON answer is an answer). A missing arguments object
    is ``{}``.
    """
    if "<tool_call>" in text:
        return [
            _call((closed or open_).strip(), ("arguments", "parameters")) for closed, open_ in _HERMES_RE.findall(text)
        ]
    body = text.strip()
    for end in _LLAMA_END:
        body = body.removesuffix(end).rstrip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if tagged or _LLAMA_START_RE.match(body):
        return [_call(body, ("parameters", "arguments"))]
    return []


# ------------------------------------------------------------------------------------------------ the environment


class _Abandoned(Exception):
    """A user tool ran past its timeout; its thread was left running."""


def _call_in_thread(fn: Callable[..., Any], args: dict, timeout_s: float) -> Any:
    """``fn(**args)`` in a daemon thread; ``_Abandoned`` past ``timeout_s`` (0 = none), leaving the thread
    running (a Python function cannot be killed), and ``fn``'s own exception re-raised."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = settle(fn(**args), timeout_s)  # an async def tool is awaited (same timeout)
        except BaseException as e:  # noqa: BLE001 (handed to the caller, who reports it)
            box["error"] = e

    thread = threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True)
    thread.start()
    thread.join(timeout_s or None)
    if thread.is_alive():
        raise _Abandoned(
            f"{getattr(fn, '__name__', 'the tool')} ran past the {timeout_s:g} s tool timeout and was "
            "abandoned (a Python function cannot be killed: it may still be running)"
        )
    if isinstance(box.get("error"), Exception):
        raise box["error"]
    if "error" in box:  # SystemExit and the like: the tool's failure, not a reason to stop the trainer
        raise RuntimeError(f"{type(box['error']).__name__}: {box['error']}")
    return box.get("value")


def _text(value: Any) -> str:
    """``str(value)`` as UTF-8-safe text; a value whose ``str`` fails (an int past the digit limit, a raising
    ``__str__``) is named by its type."""
    try:
        text = str(value)
    except Exception as e:  # noqa: BLE001 (the tool's result, not the trainer's failure)
        return f"<a {type(value).__name__} that cannot be shown as text: {type(e).__name__}>"
    return text.encode("utf-8", "replace").decode("utf-8")


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[output cut: the first {max_chars} of {len(text)} characters]"


def make_tool_env(
    tools: list[Tool], timeout_s: float = 10.0, max_output_chars: int = 4000, python_limits: PythonLimits | None = None
) -> type:
    """An environment class (``align.envs`` API) over ``tools``: one instance per episode, built from the data
    row (``messages``, or ``prompt``: a string becomes one user message). Each call runs with ``timeout_s``
    (0 = none for user tools) and its result is cut at ``max_output_chars``; the python tool runs under
    ``python_limits`` (default: ``PythonLimits`` with this wall timeout, as many CPU seconds, and this output
    length; ``timeout_s=0`` leaves it ``PythonLimits``' own timeout)."""
    if not tools:
        raise InputError(f"{FLAG}: the tool environment needs at least one tool (e.g. {FLAG} python)")
    if not (math.isfinite(timeout_s) and timeout_s >= 0) or max_output_chars < 1:
        raise ValueError(
            f"tool timeout_s must be a finite number >= 0 and max_output_chars >= 1, got {timeout_s}, {max_output_chars}"
        )
    by_name = {t.name: t for t in tools}
    schemas = [t.schema for t in tools]
    if python_limits is None:
        wall = timeout_s or PythonLimits.timeout_s  # 0 = no limit for user tools; the python tool always has one
        python_limits = PythonLimits(timeout_s=wall, cpu_s=math.ceil(wall), max_output_chars=max_output_chars)

    def run(call: dict) -> tuple[str, bool]:
        """(the tool message's content, whether it is an error)."""
        if "error" in call:
            return f"Error: {call['error']}.", True
        name, args = call["name"], call["arguments"]
        tool = by_name.get(name)
        if tool is None:
            return f"Error: there is no tool named {name!r}; the tools are {sorted(by_name)}.", True
        try:
            inspect.signature(tool.fn).bind(**args)
        except TypeError as e:
            return f"Error: wrong arguments for {name}: {e}.", True
        if tool.fn is python:
            if not isinstance(args["code"], str):
                return f'Error: "code" must be a string, got a {type(args["code"]).__name__}.', True
            ran = run_python(args["code"], python_limits)
            return ran.output, ran.timed_out
        try:
            result = _call_in_thread(tool.fn, args, timeout_s)
        except _Abandoned as e:
            return f"Error: {e}.", True
        except Exception as e:  # noqa: BLE001 (the policy reads the error; the episode goes on)
            return f"Error: {name} raised {type(e).__name__}: {_cut(_text(e), max_output_chars)}", True
        return _cut(_text(result), max_output_chars), False

    class ToolEnv:
        """One episode with the tools: the policy calls them until it answers without a call."""

        tools = schemas  # on the class: the trainer renders the chat template's tools= before any episode exists

        def __init__(self, **row: Any) -> None:
            self.row = row

        def reset(self) -> list[dict]:
            msgs = self.row.get("messages", self.row.get("prompt"))
            if isinstance(msgs, str):
                return [{"role": "user", "content": msgs}]
            if isinstance(msgs, list) and msgs:
                return copy.deepcopy(msgs)
            raise EnvError(
                f"the tool environment needs a 'messages' list or a 'prompt' string; the row has {sorted(self.row)}"
            )

        def step(self, completion: str) -> Step:
            calls = parse_tool_calls(completion)
            if not calls:
                return Step(None, None, True, {"tool_calls": 0, "tool_errors": 0})
            msgs, errors = [], 0
            for call in calls:
                content, failed = run(call)
                errors += failed
                named = {"name": call["name"]} if "name" in call else {}  # a call that cannot be read may have none
                msgs.append({"role": "tool", **named, "content": content})
            return Step(msgs, None, False, {"tool_calls": len(calls), "tool_errors": errors})

    return ToolEnv


def tool_env(cfg: Any, fns: list | None = None) -> type:
    """The tool environment over ``cfg.tools`` (an ``EnvConfig``: ``--tools`` specs) and ``fns`` (``tools=[fn]``)."""
    # a tool call gets half of the step's limit, so a slow tool is an error message the model reads, not a step timeout
    return make_tool_env(load_tools(cfg.tools, fns), timeout_s=cfg.env_timeout_s / 2 if cfg.env_timeout_s else 10.0)


class ToolEnv:
    """``--env tools`` (``--tools`` alone picks it): the row of ``align.tasks.ENVIRONMENTS`` for the tool environment.
    A recipe, never an episode itself: its ``open`` hook builds the class the episodes run (``make_tool_env``)."""

    @classmethod
    def open(cls, cfg: Any, tokenizer: Any) -> type:
        """The tool environment over ``--tools`` (``InputError`` without one)."""
        return tool_env(cfg.envs)

    def __init__(self, **row: Any) -> None:
        raise RuntimeError("ToolEnv is opened, never run: ToolEnv.open(cfg, tokenizer) returns the tool environment")

    def reset(self) -> list[dict]:  # never reached (__init__ refuses); the class is an environment for check_env_class
        raise NotImplementedError

    def step(self, completion: str) -> Step:
        raise NotImplementedError
