"""Rewards: loading ``module:function`` / ``path/file.py:function`` specs (``align.specs``), weighted sums, a worker
pool with per-call timeouts (the built-in verifiable rewards are in ``align.verifiers``).

A reward is ``fn(prompt, completion, **fields) -> float | None``; ``fields`` are the prompt row's other columns.
Several rewards are combined as ``sum_i w_i * r_i`` (``--reward-weights``, default all 1) and each is logged as
``reward/<name>_mean``.

Failure semantics (a row that fails is counted, never lost silently):
- a reward that raises or runs past ``--reward-timeout-s`` makes the completion *unscorable* (NaN total: no
  gradient), counted in ``reward_errors`` / ``reward_timeouts``;
- a reward that returns ``None`` / NaN abstains: the other rewards' weighted sum is the total, and the
  completion is unscorable only when every reward abstains (TRL's convention for multi-task rewards);
- a value float32 cannot hold (``inf``, ``1e39``; the step's rewards are float32 tensors), or a weighted sum beyond
  it, is an error like a raise: unscorable, counted in ``reward_errors``.

Execution: ``--reward-workers 1`` calls the rewards in this process; the timeout is then a SIGALRM timer on the
main thread (it interrupts Python code and sleeps, not a C call that holds the GIL) and, on another thread (the
``--max-async-steps`` producer), a watchdog that raises in that thread (Python code only: a sleep finishes first).
``--reward-workers N > 1`` runs them in N worker processes (``align.reward_pool``, JSON lines over pipes:
nothing is pickled); a call past its deadline gets its worker killed and replaced, so a hung reward never
hangs the run. Workers load the rewards from their specs, so ``fields`` must be JSON values.

Built-ins live in ``align.verifiers`` and are re-exported here, so ``--reward align.rewards:boxed_match`` works:
``exact_match``, ``boxed_match``, ``last_number_match``, ``think_answer_format``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from align import heartbeat
from align.data import InputError
from align.errors import Interrupted
from align.options import flag
from align.reward_pool import WorkerPool
from align.specs import load_spec, spec_of

# the built-ins, named as align.rewards:<fn> in specs and docs
from align.verifiers import (  # noqa: F401
    boxed_match,
    exact_match,
    last_number,
    last_number_match,
    parse_number,
    think_answer_format,
)


@dataclass
class RewardConfig:
    reward: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Reward function 'module:fn' or 'path/file.py:fn', fn(prompt, completion, **fields) -> float | None; repeat the flag for several (built-ins: align.rewards:exact_match, boxed_match, last_number_match, think_answer_format).",
            "action": "extend",
        },
    )
    reward_weights: list[float] | None = flag(
        None, "One weight per --reward (default all 1); the step's reward is the weighted sum."
    )
    reward_workers: int = flag(1, "Reward worker processes; 1 = call the rewards in this process.")
    reward_timeout_s: float = flag(
        60.0, "Per-call reward timeout in seconds (0 = none); a call past it is unscorable and counted."
    )

    def __post_init__(self) -> None:
        if self.reward_workers < 1:
            raise ValueError(f"--reward-workers must be >= 1, got {self.reward_workers}")
        if not (math.isfinite(self.reward_timeout_s) and self.reward_timeout_s >= 0):  # inf: OverflowError per call
            raise ValueError(
                f"--reward-timeout-s must be a finite number >= 0 (0 = no timeout), got {self.reward_timeout_s}"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward):
            raise ValueError(
                f"--reward-weights has {len(self.reward_weights)} value(s) for {len(self.reward)} "
                f"--reward function(s); give one weight per --reward"
            )


# ------------------------------------------------------------------------------------------------ loading


@dataclass
class RewardFn:
    name: str
    fn: Callable[..., Any]
    spec: str | None  # how a worker process loads it; None = only callable in this process
    batched: bool = False  # TRL's fn(prompts, completions, **kwargs) -> list: one call per batch, in this process

    def __post_init__(self) -> None:
        from align.reward_calls import is_batched

        self.batched = is_batched(self.fn)


def check_signature(name: str, fn: Callable[..., Any], field_names: list[str]) -> None:
    """``fn`` must accept ``(prompt, completion, **fields)`` for the data's columns, or TRL's batch signature
    ``(prompts, completions, **fields)`` (``align.reward_calls``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: let the call decide
    from align.reward_calls import accepted, is_batched

    if is_batched(fn):
        try:
            given = {"prompts": [], "completions": [], "completion_ids": [], **dict.fromkeys(field_names)}
            sig.bind(**accepted(fn, given))
        except TypeError as e:
            raise InputError(
                f"reward {name!r} takes TRL's batch signature but cannot be called as fn(prompts, completions, "
                f"**columns) for the data's columns {field_names}: {e}; add **kwargs"
            ) from None
        return
    try:
        sig.bind("prompt", "completion", **dict.fromkeys(field_names))
    except TypeError as e:
        cols = f" and the data's columns {field_names}" if field_names else ""
        raise InputError(
            f"reward {name!r} cannot be called as fn(prompt, completion, **fields){cols}: {e}; "
            f"define it as def {getattr(fn, '__name__', 'fn')}(prompt, completion, **fields)"
        ) from None


def load_rewards(specs: list[str] | None = None, fns: Any = None) -> list[RewardFn]:
    """Rewards from CLI specs, or from the Python API (a callable, or a list of callables); unique names."""
    out = []
    for spec in specs or []:
        fn = load_spec(spec)
        out.append(RewardFn(getattr(fn, "__name__", spec.rpartition(":")[2]), fn, spec))
    if fns is not None:
        for fn in fns if isinstance(fns, (list, tuple)) else [fns]:
            if not callable(fn):
                raise InputError(f"reward {fn!r} is not callable")
            out.append(RewardFn(getattr(fn, "__name__", "reward"), fn, spec_of(fn)))
    seen: dict[str, int] = {}
    for r in out:
        seen[r.name] = seen.get(r.name, 0) + 1
        if seen[r.name] > 1:
            r.name = f"{r.name}_{seen[r.name]}"
    if not out:
        raise InputError("no reward: pass --reward module:function (or path/file.py:function)")
    return out


# ------------------------------------------------------------------------------------------------ scoring


class CallTimeout(BaseException):
    """Raised inside an in-process call (a reward, an environment) by ``call_in_process``'s timer; a BaseException so
    that a user's ``except Exception`` does not catch it."""


@dataclass
class Scores:
    """One ``score`` call: per-item totals (NaN = unscorable), each reward's values, failures."""

    totals: list[float]
    terms: dict[str, list[float]]
    errors: list[str] = field(default_factory=list)  # tracebacks of raising calls
    timeouts: int = 0
    failed: int = 0  # items with at least one raising or timed-out call
    failed_at: list[int] = field(default_factory=list)  # their indices

    def item(self, j: int) -> tuple[float, dict[str, float]]:
        """Item ``j``'s total and each reward's value (NaN: unscorable / abstained)."""
        return self.totals[j], {name: values[j] for name, values in self.terms.items()}


FLOAT32_MAX = 3.4028234663852886e38  # a step's rewards become float32 tensors: a larger value cannot be trained on


def _value(v: Any) -> float:
    if v is None:
        return math.nan
    return float(v)


def _checked(kind: str, v: Any, name: str) -> tuple[str, Any]:
    """A call's result with an infinite or beyond-float32 value turned into an error (NaN stays an abstention)."""
    if kind == "ok" and not math.isnan(v) and not abs(v) <= FLOAT32_MAX:
        return "error", (
            f"reward {name!r} returned {v!r}, which float32 cannot hold (|reward| <= {FLOAT32_MAX:.4g}); "
            "the completion counts as unscorable: return a finite reward (None/NaN abstains)"
        )
    return kind, v


class _Watchdog:
    """One daemon thread for the in-process timeouts off the main thread (``_call_on_thread``): a heap of deadlines,
    where each call used to start a ``threading.Timer`` (a thread per reward call: under a busy trainer thread each
    start waited for the GIL, ~2 ms a call, 32 calls a step on the producer's critical path). An entry that finishes
    in time is only marked done (popped by the next ``arm`` or wake-up); the thread is woken only for a deadline
    earlier than the one it sleeps until."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.heap: list[tuple[float, int, dict]] = []  # (deadline, seq, entry)
        self.seq = 0
        self.thread: threading.Thread | None = None
        self.wakeup: float | None = None  # when the thread wakes next (None: only when notified)

    def arm(self, timeout_s: float) -> dict:
        import heapq
        import time

        entry = {"tid": threading.get_ident(), "done": False, "fired": False}
        deadline = time.monotonic() + timeout_s
        with self.cond:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="align-reward-timeouts", daemon=True)
                self.thread.start()
            while self.heap and self.heap[0][2]["done"]:  # finished calls: the heap holds the pending few
                heapq.heappop(self.heap)
            self.seq += 1
            heapq.heappush(self.heap, (deadline, self.seq, entry))
            if self.wakeup is None or deadline < self.wakeup:
                self.wakeup = deadline
                self.cond.notify()
        return entry

    def disarm(self, entry: dict) -> bool:
        """Marks the call finished; True when its timeout fired first (the exception may still be pending)."""
        with self.cond:
            entry["done"] = True
            return entry["fired"]

    def _loop(self) -> None:
        import ctypes
        import heapq
        import time

        set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
        with self.cond:
            while True:
                now = time.monotonic()
                while self.heap and (self.heap[0][2]["done"] or self.heap[0][0] <= now):
                    entry = heapq.heappop(self.heap)[2]
                    if not entry["done"]:
                        entry["fired"] = True
                        set_exc(ctypes.c_ulong(entry["tid"]), ctypes.py_object(CallTimeout))
                self.wakeup = self.heap[0][0] if self.heap else None
                self.cond.wait(self.wakeup - now if self.heap else None)


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):  # a forked child has no watchdog thread (and maybe a held lock): a fresh one
    os.register_at_fork(after_in_child=lambda: _WATCHDOG.__init__())


def _call_on_thread(fn: Callable, args: tuple, kwargs: dict, timeout_s: float) -> Any:
    """The timeout off the main thread (e.g. the ``--max-async-steps`` producer), where SIGALRM cannot reach: the
    watchdog (``_Watchdog``) raises ``CallTimeout`` in the calling thread (``PyThreadState_SetAsyncExc``). Like the
    alarm it interrupts Python code; unlike it, a blocking call (``time.sleep``, I/O, C code) runs to its end first,
    then the exception lands. Use ``--reward-workers`` >= 2 for rewards that block."""
    import ctypes

    entry = _WATCHDOG.arm(timeout_s)
    try:
        return fn(*args, **kwargs)
    finally:
        if _WATCHDOG.disarm(entry):  # fired but maybe not delivered yet: clear it, then report the timeout here
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(entry["tid"]), None)
            raise CallTimeout


@contextlib.contextmanager
def _stop_cuts_call(should_stop: Callable[[], int | None] | None) -> Any:
    """While a reward runs on the main thread: a SIGTERM / SIGINT runs the run's own handler (which flags the stop),
    then cuts the call with ``Interrupted``; else a reward blocked in a sleep holds the exit up to its timeout."""
    olds = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if should_stop is not None else {}
    olds = {s: h for s, h in olds.items() if callable(h)}  # SIG_DFL / SIG_IGN: nothing to chain to

    def on_stop(signum: int, frame: Any) -> None:
        olds[signum](signum, frame)
        if signum_flagged := should_stop():
            raise Interrupted(signum_flagged)

    for s in olds:
        signal.signal(s, on_stop)
    try:
        yield
    finally:
        for s, h in olds.items():
            signal.signal(s, h)


def call_in_process(
    fn: Callable, args: tuple, kwargs: dict, timeout_s: float, should_stop: Callable[[], int | None] | None = None
) -> Any:
    """``fn(*args, **kwargs)``, or ``CallTimeout`` once it runs past ``timeout_s`` (0 = no timeout): a SIGALRM timer on
    the main thread, ``_call_on_thread``'s watchdog elsewhere. A call that catches the timeout (a bare ``except:``)
    and returns or raises still ends in ``CallTimeout``. ``should_stop`` (main thread only): a SIGTERM / SIGINT that
    sets it cuts the call with ``Interrupted`` (``_stop_cuts_call``)."""
    if threading.current_thread() is not threading.main_thread():
        return _call_on_thread(fn, args, kwargs, timeout_s) if timeout_s > 0 else fn(*args, **kwargs)
    with _stop_cuts_call(should_stop):
        return _call_with_alarm(fn, args, kwargs, timeout_s)


def _call_with_alarm(fn: Callable, args: tuple, kwargs: dict, timeout_s: float) -> Any:
    if timeout_s <= 0 or not hasattr(signal, "setitimer"):
        return fn(*args, **kwargs)

    fired: list[bool] = []

    def on_alarm(signum, frame):
        fired.append(True)
        raise CallTimeout

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if fired:  # the reward caught the timeout (a bare ``except:``) and returned or raised: still a timeout
            raise CallTimeout


class RewardScorer:
    """Scores (record, completion) pairs with every reward; in-process or in a pool of worker processes."""

    def __init__(
        self, rewards: list[RewardFn], weights: list[float] | None = None, workers: int = 1, timeout_s: float = 60.0
    ):
        if weights is not None and len(weights) != len(rewards):
            raise InputError(
                f"--reward-weights has {len(weights)} value(s) for {len(rewards)} reward(s); give one "
                "weight per --reward"
            )
        self.rewards, self.weights = rewards, list(weights) if weights is not None else [1.0] * len(rewards)
        self.timeout_s = timeout_s
        self.pool = None
        if workers > 1:
            missing = [r.name for r in rewards if r.spec is None and not r.batched]
            if missing:
                raise InputError(
                    f"reward(s) {missing} are defined in __main__ or inside a function, so worker "
                    "processes cannot load them; define them in a module or file and pass "
                    "'module:function' / 'path/file.py:function', or use --reward-workers 1"
                )
            self.pool = WorkerPool([r.spec for r in rewards], workers, timeout_s)
        self._lock = threading.Lock()
        self.concurrent = False  # --group-timeout-s: in-process calls of several groups run at once (no lock)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def score(
        self,
        items: list[tuple[dict, str]],
        should_stop: Callable[[], int | None] | None = None,
        ids: list[list[int]] | None = None,
    ) -> Scores:
        """``items``: (prompt record, completion text); ``ids``: the completions' token ids, for TRL-shaped rewards
        that take ``completion_ids`` (``align.reward_calls``). Thread-safe (eval may score from another thread).

        ``should_stop`` (the run's stop flag: the signal number, if any): once it is set, scoring ends with
        ``Interrupted`` within a poll (``reward_pool.WATCH_S``) whatever the rewards do: no further call starts, a
        running one is cut (in this process on the main thread: by the signal itself; in the pool: its worker is
        killed)."""

        def check_stop() -> None:
            if should_stop is not None and (signum := should_stop()):
                raise Interrupted(signum)

        per_item = [k for k, r in enumerate(self.rewards) if not r.batched]
        got: dict[tuple[int, int], tuple[str, Any]] = {}
        lock = self._lock if self.pool is not None or not self.concurrent else contextlib.nullcontext()
        with lock, heartbeat.working("reward", items=len(items)):
            for k, r in enumerate(self.rewards):
                if r.batched:  # TRL's batch signature: one call for the whole batch, in this process
                    check_stop()
                    got.update({(i, k): res for i, res in enumerate(self._call_batched(r, items, ids, should_stop))})
            if self.pool is not None and per_item:
                calls = [(k, i, rec, text) for i, (rec, text) in enumerate(items) for k in per_item]
                done = self.pool.run([(k, prompt_of(rec), text, _fields(rec)) for k, _, rec, text in calls], check_stop)
                got.update({(i, k): res for (k, i, _, _), res in zip(calls, done)})
            else:
                for i, (rec, text) in enumerate(items):
                    for k in per_item:
                        check_stop()  # also a stop a reward swallowed (a bare ``except:``) in the call before
                        got[i, k] = self._call(self.rewards[k], (prompt_of(rec), text), _fields(rec), should_stop)
                        heartbeat.beat("reward")
            check_stop()
        results = [got[i, k] for i in range(len(items)) for k in range(len(self.rewards))]
        return self._combine(len(items), results)

    def _call(
        self, r: RewardFn, args: tuple, kwargs: dict, should_stop: Any, value: Callable = _value
    ) -> tuple[str, Any]:
        """One call of ``r`` (awaited if it is ``async``): ("ok", value) | ("timeout", why) | ("error", traceback)."""
        from align.reward_calls import settle

        def call(*a: Any, **kw: Any) -> Any:
            try:
                return settle(r.fn(*a, **kw), self.timeout_s)
            except TimeoutError:  # asyncio.wait_for's: the async reward ran past the timeout
                raise CallTimeout from None

        try:
            return "ok", value(call_in_process(call, args, kwargs, self.timeout_s, should_stop))
        except CallTimeout:
            return "timeout", f"reward {r.name!r} timed out after {self.timeout_s} s"
        except Exception:  # noqa: BLE001 -- a user's reward: counted as unscorable, the run goes on
            return "error", traceback.format_exc()

    def _call_batched(self, r: RewardFn, items: list, ids: Any, should_stop: Any) -> list[tuple[str, Any]]:
        """TRL's batch call of ``r`` over ``items``: one result per item; a wrong result fails every item."""
        from align.reward_calls import batch_kwargs, batch_values

        if not items:
            return []
        recs, texts = [rec for rec, _ in items], [t for _, t in items]
        kind, v = self._call(r, (), batch_kwargs(r.fn, recs, texts, ids), should_stop, value=lambda x: x)
        if kind == "ok":
            try:
                return [("ok", _value(x)) for x in batch_values(v, len(items), r.name)]
            except (TypeError, ValueError) as e:
                kind, v = "error", str(e)
        return [(kind, v)] * len(items)

    def _combine(self, n: int, results: list[tuple[str, Any]]) -> Scores:
        R = len(self.rewards)
        out = Scores(totals=[], terms={name: [] for name in self.names})
        for i in range(n):
            row, failed = [_checked(*res, name) for res, name in zip(results[i * R : (i + 1) * R], self.names)], False
            for (kind, v), name in zip(row, self.names):
                if kind == "ok":
                    out.terms[name].append(v)
                    continue
                failed = True
                out.terms[name].append(math.nan)
                if kind == "timeout":
                    out.timeouts += 1
                else:
                    out.errors.append(v)
            vals = [(w, v) for w, (kind, v) in zip(self.weights, row) if kind == "ok" and math.isfinite(v)]
            total = math.nan if failed or not vals else sum(w * v for w, v in vals)
            if not math.isnan(total) and not abs(total) <= FLOAT32_MAX:  # the weights pushed it out of range
                out.errors.append(
                    f"the weighted reward sum {total!r} (--reward-weights {self.weights}) is beyond "
                    f"float32 (|total| <= {FLOAT32_MAX:.4g}): the completion counts as unscorable"
                )
                total, failed = math.nan, True
            out.failed += failed
            out.failed_at += [i] if failed else []
            out.totals.append(total)
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def prompt_of(rec: dict) -> Any:
    """The prompt a reward receives: the record's text, or an environment row's ``messages`` when it has no
    ``prompt`` (``--env`` / ``--tools`` rows keep their columns)."""
    return rec["prompt"] if "prompt" in rec else rec.get("messages")


def _fields(rec: dict) -> dict:
    from align.reward_calls import CHAT_KEY

    skip = ("prompt", CHAT_KEY) if "prompt" in rec else ("messages", CHAT_KEY)
    return {k: v for k, v in rec.items() if k not in skip}


def make_scorer(cfg: RewardConfig, fns: Any, records: list[dict]) -> RewardScorer:
    """The scorer for a run: ``--reward`` specs and/or Python callables, signatures checked against the data's
    columns (all before the model loads)."""
    rewards = load_rewards(cfg.reward, fns)
    columns = sorted({k for rec in records for k in _fields(rec)})
    for r in rewards:
        check_signature(r.name, r.fn, columns)
    return RewardScorer(rewards, cfg.reward_weights, cfg.reward_workers, cfg.reward_timeout_s)
