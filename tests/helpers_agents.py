"""Agent functions for the ``--agent-processes`` tests (tests/test_agent.py), at the top level of a light module:
a worker process loads them by module and name (``helpers_agents:fn``), so importing this module costs nothing
but the stdlib. Each talks to the gateway with ``urllib``, as any HTTP client would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def ask(base_url: str, api_key: str, model: str, question: str) -> str:
    """One chat request (8 tokens at most); the reply's text."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 8}
    req = urllib.request.Request(
        base_url.rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"] or ""


def by_mode(base_url: str, api_key: str, model: str, question: str, mode: str, pids: str = "", **row) -> float:
    """One request, then what the row's ``mode`` says: ``ok`` returns 1.0, ``raise`` raises, ``crash`` exits the
    process at once (``os._exit(3)``: no reply, no traceback), ``text`` returns a string, ``hang`` starts a
    grandchild (``sleep``), writes both pids to a file in the directory ``pids`` and blocks forever."""
    ask(base_url, api_key, model, question)
    if mode == "raise":
        raise RuntimeError("the agent's own bug")
    if mode == "crash":
        os._exit(3)
    if mode == "text":
        return "five"  # type: ignore[return-value]
    if mode == "hang":
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        Path(pids, f"{os.getpid()}.json").write_text(json.dumps([os.getpid(), sleeper.pid]))
        while True:
            time.sleep(1)
    return 1.0


def fails(base_url: str, api_key: str, model: str, question: str, **row) -> float:
    ask(base_url, api_key, model, question)
    raise RuntimeError("every agent fails here")
