"""Anthropic's Messages API (``POST /v1/messages``) as a row of the gateway's ``APIS`` table: a request is turned into
the chat-completions form the gateway samples (``system`` -> a system message; ``text`` blocks -> content;
``tool_use`` blocks -> tool calls; ``tool_result`` blocks -> tool messages; ``tools`` with ``input_schema`` ->
function schemas; ``stop_sequences`` -> ``stop``) and the reply back into Anthropic's schema (``content`` blocks,
``stop_reason`` ``end_turn`` / ``max_tokens`` / ``tool_use`` / ``stop_sequence``, ``usage``), streamed as its event
sequence. The capture compares histories in one canonical form, so a reply returned as ``tool_use`` blocks matches
when the agent sends it back.
"""

from __future__ import annotations

import json
from typing import Any

from align.errors import InputError

TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none", "tool": None}  # None: the named tool
STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    503: "overloaded_error",
}


def _text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise InputError(f"{where} must be a string or a list of content blocks")
    out = []
    for b in blocks:
        if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise InputError(f"{where}: a {kind!r} block cannot be rendered by the chat template here (text only)")
        out.append(b["text"])
    return "".join(out)


def _message(m: Any, i: int) -> list[dict]:
    """One Anthropic message -> chat messages (tool results first, as the tool messages they answer)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise InputError(f"{where} needs a role 'user' or 'assistant'")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise InputError(f"{where}.content must be a string or a list of content blocks")
    text, calls, results = [], [], []
    for b in content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_use" and m["role"] == "assistant":
            fn = {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}
            calls.append({"id": b.get("id"), "type": "function", "function": fn})
        elif kind == "tool_result" and m["role"] == "user":
            body = b.get("content", "")
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": _text(body, where)})
        else:
            text.append(_text([b], where))
    out = list(results)
    if text or calls or not results:
        out.append({"role": m["role"], "content": "".join(text), **({"tool_calls": calls} if calls else {})})
    return out


def request(body: dict) -> dict:
    """An Anthropic Messages body -> the chat-completions body the gateway samples."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InputError("messages must be a non-empty list")
    chat = [m for i, m in enumerate(msgs) for m in _message(m, i)]
    if body.get("system"):
        chat.insert(0, {"role": "system", "content": _text(body["system"], "system")})
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InputError("tools must be a list of {name, description, input_schema}")
    out = {k: body[k] for k in ("model", "stream", "temperature", "top_p") if k in body}
    out["messages"] = chat
    if "max_tokens" in body:
        out["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in TOOL_CHOICE:
            raise InputError(f'tool_choice must be {{"type": "auto" | "any" | "tool" | "none"}}, got {choice!r}')
        out["tool_choice"] = TOOL_CHOICE[kind] or {"type": "function", "function": {"name": choice.get("name")}}
    if tools:
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema", {}),
                },
            }
            for t in tools
        ]
    return out


def response(resp: dict) -> dict:
    """The gateway's chat completion -> an Anthropic message."""
    choice = resp["choices"][0]
    msg = choice["message"]
    blocks: list[dict] = [{"type": "text", "text": msg["content"]}] if msg.get("content") else []
    for tc in msg.get("tool_calls") or []:
        fn = tc["function"]
        blocks.append({"type": "tool_use", "id": tc["id"], "name": fn["name"], "input": json.loads(fn["arguments"])})
    stop = resp.get("stop_sequence")
    return {
        "id": "msg_" + resp["id"].removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": resp["model"],
        "content": blocks,
        "stop_reason": "stop_sequence" if stop else STOP[choice["finish_reason"]],
        "stop_sequence": stop,
        "usage": {"input_tokens": resp["usage"]["prompt_tokens"], "output_tokens": resp["usage"]["completion_tokens"]},
    }


def events(resp: dict) -> list[tuple[str, dict]]:
    """An Anthropic message as its stream: message_start, each block (start, one delta, stop), message_delta,
    message_stop."""
    m = response(resp)
    start = {**m, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {"input_tokens": m["usage"]["input_tokens"], "output_tokens": 0}
    out: list[tuple[str, dict]] = [("message_start", {"type": "message_start", "message": start})]
    for i, b in enumerate(m["content"]):
        if b["type"] == "text":
            first, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": b["text"]}
        else:
            first = {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}
        out += [
            ("content_block_start", {"type": "content_block_start", "index": i, "content_block": first}),
            ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": i}),
        ]
    delta = {"stop_reason": m["stop_reason"], "stop_sequence": m["stop_sequence"]}
    out.append(
        (
            "message_delta",
            {"type": "message_delta", "delta": delta, "usage": {"output_tokens": m["usage"]["output_tokens"]}},
        )
    )
    out.append(("message_stop", {"type": "message_stop"}))
    return out


def error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
