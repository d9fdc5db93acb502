"""Token-exact capture of one agent episode: the requests an agent sends through the gateway, as trajectories of
policy tokens (sampled, trained) and context tokens (rendered, masked), never re-tokenizing what was sampled.

For each request the capture looks for the earlier turn whose prompt messages + the reply the gateway returned (text
and tool calls, as returned) are a prefix of the new messages (with the same tools). Then the prompt ids are that
turn's prompt ids + its sampled ids (+ the template's stop token when the turn was cut before it) + the new messages
rendered as a suffix (``align.chat.TurnRenderer.suffix``). If the turn is the tip of its trajectory, the trajectory
grows; otherwise (the agent went back to an earlier turn) a new trajectory starts whose prompt is those ids, all
context. No match (the agent edited, summarised or dropped its history, or changed its tools): a new trajectory
rendered from scratch (``TurnRenderer.first``; its tokens are counted as re-rendered). The episode is a tree of
trajectories (``Branch``); each sampled token lives in exactly one of them, the one that sampled it, with its
logprobs and weights version; every other token has mask False and logprob 0.0.

Messages are compared in a canonical form (``canon``): role, text (string or the text parts of a list), tool calls
as (name, arguments as sorted JSON), tool name; ids, ``refusal`` and other client-added fields do not count.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from align.errors import InputError

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def text_of(content: Any, where: str = "content") -> str:
    """A message's text: a string, None (""), or a list of ``{"type": "text", "text": ...}`` parts joined; any other
    part (an image, audio) is an InputError (the chat template renders text only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, dict) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str):
                out.append(p["text"])
            else:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise InputError(f"{where}: a {kind!r} part cannot be rendered by the chat template (text only)")
        return "".join(out)
    raise InputError(f"{where} must be a string or a list of text parts, got a {type(content).__name__}")


def _args(a: Any) -> Any:
    """Tool-call arguments as an object when they are JSON text (the OpenAI wire form is a string)."""
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


def _calls(m: dict, where: str) -> list[tuple[str, Any]]:
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise InputError(f"{where}.tool_calls must be a list")
    out = []
    for c in calls:
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InputError(f"{where}.tool_calls: each call needs a function name")
        out.append((fn["name"], _args(fn.get("arguments", fn.get("parameters", {})))))
    return out


def template_messages(messages: Any) -> list[dict]:
    """The request's messages as the chat templates read them: roles checked, text content, tool calls with their
    arguments as objects (``tool_call.function.arguments``)."""
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InputError(f"{where} needs a role in {sorted(ROLES)}")
        msg: dict[str, Any] = {"role": ROLES[m["role"]], "content": text_of(m.get("content"), f"{where}.content")}
        calls = _calls(m, where)
        if calls:
            msg["tool_calls"] = [
                {"type": "function", "function": {"name": n, "arguments": a}, "id": c.get("id")}
                for (n, a), c in zip(calls, m["tool_calls"])
            ]
        for k in ("name", "tool_call_id"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        out.append(msg)
    return out


def canon(m: dict) -> tuple:
    """What of a template message counts when histories are compared (ids and client-added fields do not)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True)) for c in m.get("tool_calls", ())
    )
    return (m["role"], m["content"], calls, m.get("name"))


@dataclass
class Branch:
    """One trajectory: ``prompt_ids`` (context) then ``token_ids`` with ``mask`` True on the sampled ones."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    weights_version: int = 0
    parent: int | None = None  # the branch it forked from (None: rendered from scratch)

    def context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.sampled_logprobs += [0.0] * len(ids)
        self.mask += [False] * len(ids)


@dataclass
class _Turn:
    convo: tuple  # canon(prompt messages + the reply as returned), with the tools
    branch: int
    end: int  # len(branch.token_ids) right after this turn's sampled ids
    ended: bool  # the sampled ids end with the template's stop token


@dataclass
class Plan:
    """Where a request's sample goes: ``prompt_ids`` for the generate; ``branch`` (index; -1 = a new one)."""

    prompt_ids: list[int]
    branch: int
    new: Branch | None
    convo: tuple
    prefix: list[int]  # context ids to append to the branch before the sampled ones
    messages: list[dict] = field(default_factory=list)
    start: int = 0  # the first of ``messages`` that no earlier turn had (0: rendered from scratch)

    def force(self, ids: list[int]) -> None:
        """``ids`` the gateway writes at the start of the reply (a forced tool call's opening): context after the
        prompt, never sampled (mask False)."""
        self.prompt_ids = self.prompt_ids + ids
        if self.new is not None:
            self.new.prompt_ids = self.new.prompt_ids + ids
        else:
            self.prefix = self.prefix + ids


class Capture:
    """One agent episode's requests (thread-safe; the gateway serialises an episode's requests with ``lock``).
    ``renderer(tools) -> TurnRenderer`` for the request's tools; ``stop_id``: the template's end of an assistant
    message."""

    def __init__(self, renderer: Any) -> None:
        self.renderer = renderer
        self.branches: list[Branch] = []
        self.turns: list[_Turn] = []
        self.requests = 0
        self.rerendered = 0  # tokens rendered from text (the first prompt of every branch rendered from scratch)
        self.overridden = 0  # requests that asked for their own temperature / top_p
        self.lock = threading.Lock()
        self.last = -1  # the branch the last request sampled into
        self.final: list[dict] = []  # the last request's messages + its reply
        self.index = 0  # the episode's place in its step (its draws depend on it)
        self.sample: Any = None  # the backend of the step or eval point that opened it (None: the gateway's own)
        self.top: Any = None
        self.log: list[dict] = []  # each request in order: its branch, new messages, reply, finish, token counts

    def plan(self, messages: list[dict], tools: list[dict] | None) -> Plan:
        """The prompt ids of a request (``messages`` from ``template_messages``)."""
        tkey = json.dumps(tools or [], sort_keys=True)
        keys = tuple(canon(m) for m in messages)
        best: _Turn | None = None
        for t in reversed(self.turns):
            n = len(t.convo) - 1
            if (
                t.convo[0] == tkey
                and n <= len(keys)
                and keys[:n] == t.convo[1:]
                and (best is None or n > len(best.convo) - 1)
            ):
                best = t
        convo = (tkey, *keys)
        r = self.renderer(tools)
        if best is None:
            ids = r.first(messages)
            self.rerendered += len(ids)
            return Plan(ids, -1, Branch(ids), convo, [], messages)
        b = self.branches[best.branch]
        prefix = ([] if best.ended else [r.stop_id()]) + r.suffix(messages[len(best.convo) - 1 :])
        head = b.prompt_ids + b.token_ids[: best.end]
        if best.end == len(b.token_ids):  # the tip of its trajectory: it grows
            return Plan(head + prefix, best.branch, None, convo, prefix, messages, len(best.convo) - 1)
        fork = Branch(head + prefix, parent=best.branch)
        return Plan(head + prefix, -1, fork, convo, [], messages, len(best.convo) - 1)

    def record(self, plan: Plan, c: Any, reply: dict, ended: bool, finish: str) -> None:
        """The sampled ``c`` (a Completion: token_ids, logprobs, sampled_logprobs, weights_version) of ``plan``;
        ``reply``: the assistant message as returned (a template message)."""
        if plan.new is not None:
            self.branches.append(plan.new)
            plan.branch = len(self.branches) - 1
        b = self.branches[plan.branch]
        b.context(plan.prefix)
        b.token_ids += c.token_ids
        b.logprobs += list(c.logprobs)
        b.sampled_logprobs += list(c.sampled_logprobs or c.logprobs)
        b.mask += [True] * len(c.token_ids)
        b.weights_version = c.weights_version
        b.turns.append(
            {
                "policy_tokens": len(c.token_ids),
                "env_tokens": len(plan.prefix),
                "finish_reason": finish,
                "reward": None,
                "weights_version": c.weights_version,
            }
        )
        self.turns.append(_Turn((*plan.convo, canon(reply)), plan.branch, len(b.token_ids), ended))
        self.last = plan.branch
        self.final = [*plan.messages, reply]
        self.log.append(
            {
                **b.turns[-1],
                "request": len(self.log),
                "branch": plan.branch,
                "parent": b.parent if len(b.turns) == 1 else plan.branch,
                "new_messages": plan.messages[plan.start :],
                "reply": reply,
                "context_tokens": len(plan.prompt_ids) if len(b.turns) == 1 else len(plan.prefix),  # all masked
            }
        )
