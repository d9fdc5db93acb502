"""How a user's function is called: TRL-shaped batch rewards and ``async def`` rewards and tools.

- **TRL's batch signature** ``fn(prompts, completions, **kwargs) -> list[float | None]`` is detected from its
  parameter names (``completions``, plural; TRL's quickstart takes ``completions, **kwargs`` only) and called once
  per step's batch, as TRL's
  ``GRPOTrainer`` does: ``prompts`` / ``completions`` one entry per completion; a conversational prompt (a chat
  row) is its list of messages and its completion ``[{"role": "assistant", "content": text}]``, else both are
  strings; each other column of the rows as a list (``answer=[...]``); ``completion_ids`` (the sampled token ids)
  when the caller has them. Each goes in when the function names it or takes ``**kwargs``. A result that is not a list with one
  value per completion makes the whole batch unscorable (counted in ``reward_errors``), as a raise does.
- **``async def``** rewards and tools (or any function returning an awaitable) are awaited in a fresh event loop
  under the same timeout as a plain call (``asyncio.wait_for``; the caller's own timer stays as the backstop).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

CHAT_KEY = "_chat"
"""A record's hidden copy of its chat prompt (``align.data.to_record``), for conversational batch rewards; never
one of the fields a reward receives."""


def is_batched(fn: Callable[..., Any]) -> bool:
    """TRL's batch reward: a parameter named ``completions``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "completions" in params


def accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``kwargs`` that ``fn`` takes (all of them when it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def settle(value: Any, timeout_s: float = 0.0) -> Any:
    """``value``, or what it resolves to when it is awaitable (an ``async def``'s coroutine), awaited in a fresh event
    loop within ``timeout_s`` (0 = none); past it, ``TimeoutError``."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await asyncio.wait_for(value, timeout_s or None)

    return asyncio.run(wait())


def batch_kwargs(
    fn: Callable[..., Any], records: list[dict], texts: list[str], ids: list[list[int]] | None
) -> dict[str, Any]:
    """The keyword arguments TRL would pass ``fn`` for these (record, completion) pairs."""
    chat = [rec.get(CHAT_KEY) if CHAT_KEY in rec else _raw_chat(rec) for rec in records]
    prompts = [c if c is not None else _prompt_text(rec) for c, rec in zip(chat, records)]
    completions = [
        [{"role": "assistant", "content": t}] if c is not None else t for c, t in zip(chat, texts, strict=True)
    ]
    columns = sorted({k for rec in records for k in rec if k not in ("prompt", "messages", CHAT_KEY)})
    kw: dict[str, Any] = {"prompts": prompts, "completions": completions}
    kw.update({k: [rec.get(k) for rec in records] for k in columns})
    if ids is not None:
        kw["completion_ids"] = ids
    return accepted(fn, kw)


def _raw_chat(rec: dict) -> list | None:
    """An environment's row keeps its ``messages`` column (no rendered ``prompt``)."""
    msgs = rec.get("messages")
    return msgs if "prompt" not in rec and isinstance(msgs, list) else None


def _prompt_text(rec: dict) -> Any:
    return rec.get("prompt", rec.get("messages"))


def batch_values(result: Any, n: int, name: str) -> list[Any]:
    """``result`` checked as TRL's: a list (or tuple) of ``n`` floats / None; ``ValueError`` naming the reward."""
    if not isinstance(result, (list, tuple)):
        raise ValueError(  # noqa: TRY004 -- a user's reward: counted as an error, never a crash
            f"reward {name!r} takes TRL's batch signature (prompts, completions, **kwargs) but returned a "
            f"{type(result).__name__}; return a list with one float (or None) per completion"
        )
    if len(result) != n:
        raise ValueError(
            f"reward {name!r} returned {len(result)} value(s) for {n} completion(s); return one float (or None) per "
            "completion: the step's completions are unscorable"
        )
    return list(result)
