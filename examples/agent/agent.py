"""A tool-using agent written only against the ``openai`` client (no align import): a function-calling loop with one
small tool. align trains the model behind it unchanged (docs/agent.md):

    python -m align.train --model DIR --train-data examples/agent/rows.jsonl --agent examples/agent/agent.py:run

``run(base_url, api_key, model, **row)`` is the agent contract: the row's columns arrive as keywords (here
``question`` and ``answer``); the return value is the reward.
"""

from __future__ import annotations

import json

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def add(a: int, b: int) -> int:
    return a + b


def run(base_url: str, api_key: str, model: str, question: str, answer: str, max_turns: int = 3, **row) -> float:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return float(str(answer) in (reply.content or ""))
        for call in reply.tool_calls:
            try:
                result = str(add(**json.loads(call.function.arguments)))
            except (ValueError, TypeError) as e:  # the model's malformed call: it reads the error
                result = f"Error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})
    return 0.0
