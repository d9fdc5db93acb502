"""``--agent-processes``: each agent run in a worker process of its own (``python -m align.gateway.workers
--worker``, an ``align.child.Child``), so an agent that blocks, crashes (``os._exit``, a segfault) or leaks never
takes the trainer with it.

- **By spec, nothing pickled**: the worker loads the agent from its spec (``path/file.py:fn`` / ``module:fn``; a
  Python-API ``agent=fn`` must be importable by module and qualname, ``align.specs.spec_of``). One JSON line goes in
  (the spec, ``base_url``, the episode's ``api_key``, ``model``, the row), one comes back: ``{"ok": value}`` (the
  agent's float / dict / None) or ``{"error": text}`` (its traceback, or a value JSON cannot carry, named).
  The agent talks to the gateway over HTTP as a thread's does; its prints go to the worker's stderr.
- **The same pool and deadline as the threads** (``agents.run_pool``): at most ``--agent-workers`` processes at
  once, one per run; the step waits ``--agent-timeout-s`` for them all. A run still going then is killed with its
  process group (what the agent started dies with it); one that exits without an answer is named by its exit code.
  A worker whose trainer is gone (even by SIGKILL) kills its own group (``exit_with_parent``).

The failures come back as ``AgentFailed`` (its ``text``: the child's traceback, or why the process ended) and
``AgentTimeout``; ``agents._Agents.episode`` turns them into the thread pool's unscorable, counted episodes.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from align.child import Child, ChildError, child_stdio
from align.errors import InputError
from align.specs import load_spec, spec_of

MAX_REPLY_BYTES = 16 << 20  # the agent's return value or its traceback; a bigger reply fails the run


class AgentFailed(RuntimeError):
    """An agent run in a worker process raised, died or answered garbage; ``text`` says which (the traceback)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class AgentTimeout(RuntimeError):
    """An agent run in a worker process was still going at the step's deadline: killed with its process group."""


def agent_spec(spec: str | None, fn: Callable[..., Any]) -> str:
    """The spec a worker loads the agent from: ``--agent``'s own, else the Python-API function's module and
    qualname, which must load back to ``fn``; else an ``InputError`` naming --agent-processes."""
    if spec:
        return spec
    found = spec_of(fn)
    ok = False
    if found is not None:
        with contextlib.suppress(InputError):
            ok = load_spec(found, "--agent") is fn
    if not ok:
        raise InputError(
            f"--agent-processes loads the agent in each worker process by its module and name, and "
            f"{getattr(fn, '__qualname__', fn)!r} cannot be imported so (defined in __main__, inside a function, a "
            "lambda or a bound object): define it at the top level of a module or file and pass --agent "
            "path/file.py:fn, or run without --agent-processes"
        )
    return found


def run_processes(
    spec: str, jobs: list[dict], workers: int, timeout_s: float | None, pool: Callable[..., list[cf.Future]]
) -> list[cf.Future]:
    """``jobs`` (each ``{"base_url", "api_key", "model", "row"}``) run in worker processes on ``pool``
    (``agents.run_pool``: ``workers`` at once, ``timeout_s`` for them all). Returns the futures as ``pool`` left
    them, each unfinished run's process group killed."""
    try:
        json.dumps(jobs)
    except (TypeError, ValueError) as e:
        raise InputError(
            f"--agent-processes sends each row to its worker process as JSON, and a row is not JSON values ({e}); "
            "convert the row's columns or run the agents on threads (without --agent-processes)"
        ) from None
    deadline = time.monotonic() + timeout_s if timeout_s else math.inf
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    lock, live, over = threading.Lock(), set(), [False]

    def run(job: dict) -> Any:
        child = Child(
            [sys.executable, "-m", "align.gateway.workers", "--worker"],
            max_bytes=MAX_REPLY_BYTES,
            env=env,
            what="the agent's worker process",
        )
        with lock:
            live.add(child)
            if over[0]:  # started as the step ended: never runs
                child.kill()
        try:
            with contextlib.suppress(ChildError):  # exited at once: the read names its exit code
                child.send({"spec": spec, **job})
            try:
                reply = child.read(deadline)
            except (ChildError, OSError, ValueError) as e:  # OSError / ValueError: its pipes closed by the kill
                if over[0] or getattr(e, "kind", None) == "timeout":  # killed at the step's end, or past its deadline
                    raise AgentTimeout("the agent's worker process was still running at the deadline") from None
                raise AgentFailed(f"{e}; its stderr says why") from None
            if not isinstance(reply, dict) or not ({"ok", "error"} & reply.keys()):
                raise AgentFailed(f"the agent's worker process answered {reply!r:.200}")
            if "error" in reply:
                raise AgentFailed(str(reply["error"]))
            return reply["ok"]
        finally:
            with lock:
                live.discard(child)
                child.kill()  # its group: what the agent started dies with it

    futs = pool([lambda j=j: run(j) for j in jobs], workers, timeout_s)
    with lock:  # the runs still going: killed, each raises AgentTimeout (if its future is read once done)
        over[0] = True
        for child in live:
            child.kill()
    return futs


def _worker_main() -> None:
    """One agent run: a JSON line in on stdin, the agent's return value (or traceback) out on the original stdout;
    the agent's prints go to stderr, its reads of stdin see an empty file."""
    from align.rollout.process import exit_with_parent

    inp, out = child_stdio()
    exit_with_parent(os.getppid(), grace_s=0)  # a trainer gone (even by SIGKILL) takes the agent's group with it
    job = json.loads(inp.readline())
    try:
        fn = load_spec(job["spec"], "--agent")
        value = fn(job["base_url"], job["api_key"], job["model"], **job["row"])
        try:
            text = json.dumps({"ok": value})
        except (TypeError, ValueError) as e:  # a numpy scalar, an object: no number the trainer could read
            text = json.dumps(
                {
                    "error": f"the agent returned {value!r:.200}, which is not JSON ({e}): expected a finite number, "
                    "a dict with 'reward' or None (with --agent-processes it comes back as JSON)"
                }
            )
    except BaseException:  # noqa: BLE001 -- the agent's failure (SystemExit included): reported, the episode fails
        text = json.dumps({"error": "the agent raised (in its worker process):\n" + traceback.format_exc()})
    out.write(text + "\n")
    out.flush()
    os._exit(0)  # the agent's leftover threads (a client's pool) never hold the run up


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()
