"""The reward worker pool of ``--reward-workers N > 1``: N processes (``python -m align.reward_pool --worker``)
that load the rewards from their specs and answer JSON lines over pipes (``align.child.Child``; nothing is pickled,
so ``fields`` must be JSON values; a reply over ``MAX_REPLY_BYTES`` fails its call and replaces the worker). A call past its deadline gets its worker killed with its process group (what the reward started) and
replaced, so a hung reward never hangs the run; a worker that exited while a forked child holds its pipe is noticed
from its pid (``WATCH_S``). ``align.rewards.RewardScorer`` drives it; the failure semantics are its docstring's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from align.child import Child, ChildError, child_stdio, close_all
from align.data import InputError
from align.reward_calls import settle
from align.specs import load_spec

WATCH_S = 0.2  # how often the pool checks its busy workers are alive (a pipe can outlive its worker)
STARTUP_TIMEOUT_S = 120.0  # a worker's start (python + the reward modules) never counts against a call's timeout
CLOSE_GRACE_S = 5.0  # close(): how long workers get to exit on EOF before their process group is killed
MAX_REPLY_BYTES = 16 << 20  # one reply (a float or a traceback); a bigger one fails its call, the worker is replaced


class _Worker:
    """One worker process (an ``align.child.Child``), its task and its deadline."""

    def __init__(self, specs: list[str], sel: selectors.BaseSelector):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        argv = [sys.executable, "-m", "align.reward_pool", "--worker"]
        self.child = Child(argv, max_bytes=MAX_REPLY_BYTES, env=env, what="a reward worker")
        self.proc = self.child.proc
        self.sel, self.ready = sel, False
        self.task: int | None = None
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S  # until ready: the start deadline
        with contextlib.suppress(ChildError):  # died at once: the read reports it
            self.child.send({"specs": specs})
        sel.register(self.child.fileno(), selectors.EVENT_READ, self)

    def kill(self) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(self.child.fileno())
        self.child.kill()


class WorkerPool:
    """N worker processes running reward calls with a per-call deadline; a late or dead worker is replaced."""

    def __init__(self, specs: list[str], n: int, timeout_s: float):
        self.specs, self.n, self.timeout_s = specs, n, timeout_s
        self.sel = selectors.DefaultSelector()
        self.workers: list[_Worker] = []

    def _replace(self, j: int) -> None:
        self.workers[j].kill()
        self.workers[j] = _Worker(self.specs, self.sel)

    def run(
        self, calls: list[tuple[int, str, str, dict]], check_stop: Callable[[], None] = lambda: None
    ) -> list[tuple[str, Any]]:
        """``calls``: (reward index, prompt, completion, fields) -> [("ok", float) | ("error", tb) | ("timeout", msg)].
        ``check_stop`` runs every ``WATCH_S`` at most; what it raises (``Interrupted``) ends the run, its busy
        workers killed (replaced before the next call)."""
        results: list[tuple[str, Any] | None] = [None] * len(calls)
        payloads = []
        for k, prompt, completion, fields in calls:
            try:
                payloads.append(json.dumps({"r": k, "prompt": str(prompt), "completion": completion, "fields": fields}))
            except (TypeError, ValueError) as e:
                raise InputError(
                    f"--reward-workers > 1 sends each row's fields to the workers as JSON, and a row's "
                    f"fields are not JSON values ({e}); use --reward-workers 1"
                ) from None
        while len(self.workers) < self.n:
            self.workers.append(_Worker(self.specs, self.sel))
        todo = list(range(len(calls)))[::-1]
        while todo or any(w.task is not None for w in self.workers):
            try:
                check_stop()
            except BaseException:
                for w in self.workers:
                    if w.task is not None:
                        w.kill()
                        w.task, w.ready, w.deadline = None, True, math.inf  # dead: replaced before its next task
                raise
            for w in self.workers:
                if w.ready and w.task is None and todo:
                    t = todo.pop()
                    w.task, w.deadline = t, time.monotonic() + self.timeout_s if self.timeout_s > 0 else math.inf
                    with contextlib.suppress(ChildError):  # died since its last answer: the read below sees it
                        w.child.send(f'{{"id": {t}, "call": {payloads[t]}}}')
            wait = (
                max(0.0, min(w.deadline for w in self.workers if w.task is not None or not w.ready) - time.monotonic())
                if any(w.task is not None or not w.ready for w in self.workers)
                else 0.0
            )
            for key, _ in self.sel.select(timeout=min(wait, WATCH_S)):
                self._read(key.data, results)
            for w in self.workers:  # exited, but a process it forked holds its pipe open: no EOF ever comes
                if w.task is not None and w.proc.poll() is not None:
                    self._drain_dead(w, results)
            now = time.monotonic()
            for j, w in enumerate(self.workers):
                if now < w.deadline:
                    continue
                if not w.ready:
                    w.kill()
                    raise RuntimeError(
                        f"a reward worker did not start within {STARTUP_TIMEOUT_S} s (loading {self.specs})"
                    )
                if w.task is not None:
                    results[w.task] = ("timeout", f"reward call timed out after {self.timeout_s} s")
                    self._replace(j)
            for j, w in enumerate(self.workers):
                if w.task is None and w.ready and not w.child.alive():
                    self._replace(j)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _drain_dead(self, w: _Worker, results: list) -> None:
        """A worker whose process exited: its last answer if it wrote one, else its task is an error."""
        while w.task is not None and not w.child.killed and w.child.readable():
            self._read(w, results)
        if w.task is not None:
            rc = w.proc.returncode
            results[w.task] = ("error", f"reward worker exited (exit code {rc}) while scoring; see its stderr")
            w.task = None
        w.kill()
        w.ready, w.deadline = True, math.inf  # dead: replaced before its next task

    def _read(self, w: _Worker, results: list) -> None:
        try:
            if not w.child.feed():  # EOF: killed first (it may have closed stdout and gone on), then named
                w.kill()
                return self._dead(w, results, f"died (exit code {w.proc.returncode}) while scoring; see its stderr")
            while (msg := w.child.pop()) is not None:
                if isinstance(msg, dict) and msg.get("ready"):
                    w.ready, w.deadline = True, math.inf
                elif isinstance(msg, dict) and w.task is not None and msg.get("id") == w.task:
                    v = msg.get("value")
                    results[w.task] = (
                        ("ok", math.nan if v is None else float(v)) if "value" in msg else ("error", msg["error"])
                    )
                    w.task, w.deadline = None, math.inf
        except ChildError as e:  # a reply past the cap, or not JSON: the stream is out of step
            self._dead(w, results, f"was killed: {e}")

    def _dead(self, w: _Worker, results: list, why: str) -> None:
        w.kill()
        if not w.ready:
            raise RuntimeError(
                f"a reward worker exited while loading {self.specs} (exit code {w.proc.returncode}); its error is "
                "on stderr above"
            )
        if w.task is not None:
            results[w.task] = ("error", f"reward worker {why}")
            w.task = None
        w.ready, w.deadline = True, math.inf  # dead: replaced before its next task

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(w.child.fileno())
        close_all([w.child for w in self.workers], CLOSE_GRACE_S)
        self.workers = []
        self.sel.close()


def _worker_main() -> None:
    """A pool worker: JSON lines in on stdin, results out on the original stdout (the reward's prints go to stderr)."""
    inp, out = child_stdio()
    init = json.loads(inp.readline())
    fns = [load_spec(s) for s in init["specs"]]
    out.write(json.dumps({"ready": True}) + "\n")
    for line in inp:
        msg = json.loads(line)
        call = msg["call"]
        try:
            v = settle(fns[call["r"]](call["prompt"], call["completion"], **call["fields"]))  # async def: awaited
            reply = {"id": msg["id"], "value": None if v is None else float(v)}
        except Exception:  # noqa: BLE001 -- reported to the trainer, which counts it
            reply = {"id": msg["id"], "error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()
