"""Running environments: the episodes of one environment class, in this process (``--env-workers 0``) or in N
worker processes (``--env-workers N``), with a deadline on every call (``--env-timeout-s``, 0 = none).

One interface for both modes, ``EnvRunner``: ``open(episode, row)`` constructs ``cls(**row)``, ``reset`` / ``step``
call the episode's instance and check what it returns (``check_observation`` / ``check_step``), ``close_episode``
drops it, and ``call_many`` runs a batch of calls at once (the native sampler steps all live episodes together).

Failures: every failure of a call is an ``EnvError`` whose message holds the traceback of the environment's code,
or "timed out after --env-timeout-s N s" (``EnvTimeout``, its subclass); the caller counts the episode as failed.
A call given a ``deadline`` (``--group-timeout-s``: its group's) is bounded by what is left of it, and cut there
(``EnvEvicted``: the caller evicts the episode's group); ``call_many`` then waits for no call past it (plus a grace).

In process (``workers=0``): the deadline is the reward code's (``align.rewards.call_in_process``): a SIGALRM timer
on the main thread (it interrupts Python code and sleeps), a watchdog on other threads (Python code only: a sleep
finishes first); a bare ``except:`` in the environment cannot swallow it. Calls are serialised by one lock, so an
environment class need not be thread-safe; a class that sets ``concurrent = True`` has only its calls on one episode
serialised (a lock per episode: an instance is never entered by two threads), and different episodes' calls run at
once, so a step that waits (I/O, a sleep, a verifier) holds up only its own episode. The call lock is not the episode
table's: a call abandoned at a deadline while it holds the call lock never blocks ``close_episode``, and later calls
with a deadline give up waiting for it there.

Worker processes (``workers >= 1``, ``python -m align.envs.runner --worker``): each worker loads the class from the
spec once and keeps a dict episode -> instance; an episode's state lives only in its worker, and the episode is
sticky to the worker its ``open`` went to (the least loaded). Requests and replies are JSON lines over pipes
(``align.child.Child``; nothing is pickled, so a row must be JSON values); the environment's prints go to the
worker's stderr, never into the protocol. A reply over ``MAX_REPLY_BYTES`` fails its call as soon as that many
bytes arrived (read in linear time, never whole) and the worker is replaced. Calls on one worker are serialised, calls on different workers run in parallel. A call past its
deadline gets its worker killed with its process group (what the environment started dies with it) and replaced
by a fresh one; a worker that exits (``os._exit``, a segfault) is noticed by its pid and replaced the same way.
Either way the worker's *other* episodes are lost with it: their next call raises ``EnvError`` ("the worker was
replaced ..."). A worker whose trainer is gone (even by SIGKILL) kills its process group.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
import traceback
from typing import Any

from align import heartbeat
from align.child import Child, ChildError, child_stdio, close_all
from align.data import InputError
from align.envs import EnvError, Step, check_env_class, check_observation, check_step
from align.rewards import CallTimeout, call_in_process, load_spec, spec_of

STARTUP_TIMEOUT_S = 120.0  # a worker's start (python + the environment's module) never counts against a call
MAX_REPLY_BYTES = 16 << 20  # one worker reply; a bigger one fails its call (read no further) and replaces the worker
CLOSE_GRACE_S = 5.0  # close(): how long workers get to exit on EOF before their process group is killed
OPS = ("open", "reset", "step")
CUT_GRACE_S = 1.0  # call_many with a deadline: how long past it a cut call gets to report before it is abandoned


class EnvTimeout(EnvError):
    """An environment call ran past ``--env-timeout-s``."""


class EnvEvicted(EnvError):
    """An environment call cut (or never started) at its group's deadline (``--group-timeout-s``): the episode's
    group is evicted (``align.rollout.deadlines``)."""


def load_env_class(spec: str, flag: str = "--env") -> type:
    """The environment class named by ``module:Class`` or ``path/file.py:Class`` (a built-in name is resolved first
    by ``align.tasks.env_spec``); ``InputError`` naming ``flag`` for a spec without module or class, a missing file or
    module, something that is not a class, or a class without ``reset`` / ``step``."""
    cls = load_spec(spec, flag, kind="Class")
    check_env_class(cls, flag)
    return cls


# ------------------------------------------------------------------------------------------------ one call


def _row_brief(row: Any) -> str:
    r = repr(row)
    return r if len(r) <= 120 else r[:117] + "..."


def _user_call(fn: Any, args: tuple, kwargs: dict, what: str, row: Any, timeout_s: float) -> Any:
    """The environment's code, its exception or timeout turned into an ``EnvError`` naming the call and the row."""
    try:
        return call_in_process(fn, args, kwargs, timeout_s)
    except CallTimeout:
        raise EnvTimeout(f"{what} timed out after --env-timeout-s {timeout_s} s (row {_row_brief(row)})") from None
    except Exception:  # noqa: BLE001 -- the environment's error: the episode fails, the run goes on
        raise EnvError(f"{what} raised (row {_row_brief(row)}):\n{traceback.format_exc()}") from None


def _apply(envs: dict[int, tuple[Any, dict]], cls: type, op: str, episode: int, arg: Any, timeout_s: float) -> Any:
    """``op`` on ``episode`` (``envs``: episode -> (instance, row)), its result checked. The same code runs in this
    process and in a worker, so both modes give the same results and messages."""
    if op == "open":
        envs[episode] = (_user_call(cls, (), arg, f"{cls.__name__}(**row)", arg, timeout_s), arg)
        return None
    if episode not in envs:  # the caller checks first; a worker must not die of it
        raise EnvError(f"episode {episode} has no environment instance here (its open failed or never ran)")
    env, row = envs[episode]
    if op == "reset":
        obs = _user_call(env.reset, (), {}, "reset()", row, timeout_s)
        return check_observation(obs, f"reset() (row {_row_brief(row)})")
    out = _user_call(env.step, (arg,), {}, "step()", row, timeout_s)
    return check_step(out, f"step() (row {_row_brief(row)})")


# ------------------------------------------------------------------------------------------------ a worker


class _Worker:
    """One worker process (an ``align.child.Child``) and, once it is lost (timed out, exited, a reply too big),
    why."""

    def __init__(self, spec: str):
        self.spec = spec
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.child = Child(
            [sys.executable, "-m", "align.envs.runner", "--worker"],
            max_bytes=MAX_REPLY_BYTES,
            env=env,
            what="the environment worker",
        )
        self.proc = self.child.proc
        self.started = time.monotonic()
        self.ready, self.next_id = False, 0
        self.lost: str | None = None
        with contextlib.suppress(ChildError):  # died at once: the startup read reports it
            self.child.send({"spec": spec})

    def request(self, payload: str, timeout_s: float, what: str) -> Any:
        """Send one call and wait for its reply: the value, or ``EnvError`` (the environment's error, the worker's
        exit, a reply over ``MAX_REPLY_BYTES``) / ``EnvTimeout``; after any but the environment's own error the
        worker is killed and ``lost`` says why."""
        if not self.ready:
            self._wait_ready()
        self.next_id += 1
        with contextlib.suppress(ChildError):  # exited (or closed) since its last reply: the read sees it
            self.child.send(f'{{"id": {self.next_id}, "call": {payload}}}')
        try:
            reply = self.child.read(time.monotonic() + timeout_s if timeout_s > 0 else math.inf)
        except ChildError as e:
            if e.kind == "timeout":
                self._lose(f"{what} timed out after --env-timeout-s {timeout_s} s")
                raise EnvTimeout(f"{self.lost}; its worker was killed (with what it started) and replaced") from None
            self.kill()
            if e.kind == "eof":
                self.lost = f"the environment worker exited (exit code {self.proc.returncode}) during {what}"
                raise EnvError(f"{self.lost}; its stderr says why") from None
            self.lost = f"{e} during {what}"
            raise EnvError(f"{self.lost}; the worker was killed and replaced") from None
        if not isinstance(reply, dict) or reply.get("id") != self.next_id:
            self._lose(f"the environment worker answered out of turn ({reply!r:.80}) during {what}")
            raise EnvError(f"{self.lost}; its stderr says why")
        if "error" in reply:
            raise EnvError(reply["error"])
        return reply["ok"]

    def _wait_ready(self) -> None:
        try:
            reply = self.child.read(self.started + STARTUP_TIMEOUT_S)
        except ChildError as e:
            why = {
                "timeout": f"did not start within {STARTUP_TIMEOUT_S} s",
                "eof": "exited while loading it; its stderr says why",
            }.get(e.kind, f"answered its start with {e}")
            self._lose(f"an environment worker for {self.spec!r} {why}")
            raise EnvError(self.lost) from None
        if isinstance(reply, dict) and reply.get("ready"):
            self.ready = True
            return
        self._lose(f"an environment worker for {self.spec!r} could not load it:\n{reply.get('error')}")
        raise EnvError(self.lost)

    def send_close(self, episode: int) -> None:
        """Drop an episode's instance (no reply: nothing the caller could act on)."""
        if self.lost is None:
            with contextlib.suppress(ChildError):
                self.child.send(f'{{"id": null, "call": {{"op": "close", "episode": {episode}}}}}')

    def _lose(self, why: str) -> None:
        self.lost = why
        self.kill()

    def kill(self) -> None:
        """SIGKILL to the worker's process group, once, and reap it."""
        self.child.kill()


# ------------------------------------------------------------------------------------------------ the runner


class EnvRunner:
    """Episodes of one environment class: in this process (``workers=0``) or in N worker processes
    (``workers >= 1``, each episode sticky to one worker). Thread-safe: several threads may call at once (calls on
    different workers run in parallel; calls on one worker, or in process, are serialised, unless the class sets
    ``concurrent = True``: then in-process calls on different episodes run at once (one episode's calls stay
    serialised by its own lock), and ``call_many`` gives each its own thread).

    A call that fails raises ``EnvError`` (``EnvTimeout`` past ``timeout_s``) with the environment's traceback; the
    episode stays open. A worker killed for a timeout, or one that exited, is replaced, and it takes its *other*
    episodes with it: their next call raises ``EnvError`` ("the worker was replaced ..."). ``spec`` is how a worker
    loads the class (``path/file.py:Class`` / ``module:Class``; derived from ``cls`` when it is importable); ``cls``
    is used in process (the Python API's ``env=MyEnv``)."""

    def __init__(self, spec: str | None, cls: type | None, workers: int, timeout_s: float):
        if workers < 0:
            raise ValueError(f"--env-workers must be >= 0 (0 = in process), got {workers}")
        if not timeout_s >= 0:
            raise ValueError(f"--env-timeout-s must be >= 0 (0 = no timeout), got {timeout_s}")
        if cls is None:
            if spec is None:
                raise ValueError("EnvRunner needs an environment: a spec ('path/file.py:Class') or a class")
            cls = load_env_class(spec)
        check_env_class(cls)
        self.cls, self.workers, self.timeout_s = cls, workers, timeout_s
        # a class that sets ``concurrent = True`` (its instances are independent and thread-safe, e.g. each waits on
        # a shared verifier pool) is called without the in-process lock, and call_many runs its calls at once
        self.concurrent = not workers and getattr(cls, "concurrent", False) is True
        self._lock = threading.Lock()  # the episode tables
        self._call_lock = threading.Lock()  # in process: every call (a class that is not concurrent)
        self._envs: dict[int, tuple[Any, dict]] = {}  # in process: episode -> (instance, row)
        self._episode_locks: dict[int, threading.Lock] = {}  # in process, concurrent classes: one per episode
        self._home: dict[int, tuple[int, _Worker | None]] = {}  # with workers: episode -> (slot, its worker)
        self._load = [0] * workers  # open episodes per slot
        self._closed = False
        self._pool: list[_Worker] = []
        if workers >= 1:
            self.spec = spec or spec_of(cls)
            if self.spec is None:
                raise InputError(
                    f"--env-workers {workers}: the environment class {cls.__qualname__} is defined in __main__ or "
                    "inside a function, so worker processes cannot load it; define it in a module or file and pass "
                    "--env 'module:Class' / 'path/file.py:Class', or use --env-workers 0"
                )
            self._slot_locks = [threading.Lock() for _ in range(workers)]
            self._pool = [_Worker(self.spec) for _ in range(workers)]

    def open(self, episode: int, row: dict) -> None:
        """Construct ``cls(**row)`` for ``episode``; ``row`` must be JSON values with workers (``InputError``)."""
        self._run(self._route(episode, "open"), episode, "open", self._payload(episode, "open", row), row)

    def reset(self, episode: int) -> list[dict] | str:
        """The episode's first messages (chat) or plain prompt, checked with ``check_observation``."""
        return self._run(self._route(episode, "reset"), episode, "reset", self._payload(episode, "reset", None), None)

    def step(self, episode: int, completion: str, deadline: float = math.inf) -> Step:
        """The environment's answer to the policy's ``completion``, checked with ``check_step``; past ``deadline``
        (``time.monotonic()``; the group's, ``--group-timeout-s``) the call is cut: ``EnvEvicted``."""
        payload = self._payload(episode, "step", completion)
        return self._run(self._route(episode, "step"), episode, "step", payload, completion, deadline)

    def call_many(
        self, calls: list[tuple[int, str, tuple]], deadline: float | list[float] = math.inf, took: list | None = None
    ) -> list:
        """``[(episode, "open" | "reset" | "step", args)]`` run concurrently (one thread per worker involved, each
        running its calls in order; in order in process): each result is the value or the ``EnvError`` (returned,
        not raised). A row that is not JSON raises ``InputError`` before anything runs. With a ``deadline`` (one for
        all, or one per call) the calls run on threads, each cut at its deadline (``EnvEvicted``: a worker's call by
        killing its worker, in process where Python can interrupt it), and are waited for ``CUT_GRACE_S`` past it
        only: a call not back by then is abandoned on its daemon thread and its result is ``EnvEvicted`` too.
        ``took``: filled with each call's seconds (an abandoned one: until it was given up)."""
        payloads = [self._payload(e, op, args[0] if args else None) for e, op, args in calls]
        slots = [self._route(e, op) for e, op, _ in calls]
        deadlines = deadline if isinstance(deadline, list) else [deadline] * len(calls)
        results: list[Any] = [None] * len(calls)
        seconds = [0.0] * len(calls)
        queues: dict[int, list[int]] = {}
        for i, j in enumerate(slots):
            queues.setdefault(j, []).append(i)

        def drain(idx: list[int]) -> None:
            for i in idx:
                e, op, args = calls[i]
                t0 = time.monotonic()
                try:
                    results[i] = self._run(slots[i], e, op, payloads[i], args[0] if args else None, deadlines[i])
                except Exception as err:  # noqa: BLE001 -- EnvError is the call's result; others re-raised below
                    results[i] = err
                seconds[i] = time.monotonic() - t0

        if self.concurrent:
            queues = {i: [i] for i in range(len(calls))}
        start = time.monotonic()
        if len(queues) <= 1 and max(deadlines, default=math.inf) == math.inf:
            drain(list(range(len(calls))))
        else:
            threads = [(threading.Thread(target=drain, args=(idx,), daemon=True), idx) for idx in queues.values()]
            for t, _ in threads:
                t.start()
            for t, idx in threads:
                last = max(deadlines[i] for i in idx)
                t.join(None if last == math.inf else max(0.0, last + CUT_GRACE_S - time.monotonic()))
            late = {t.ident for t, _ in threads if t.is_alive()}
            if late:  # abandoned at the deadline: the watchdog no longer counts their calls
                heartbeat.forget(late)
                for i, r in enumerate(results):
                    if r is None:
                        results[i] = EnvEvicted(
                            f"{calls[i][1]}() of episode {calls[i][0]}: {_past(deadlines[i])} (abandoned)"
                        )
                        seconds[i] = time.monotonic() - start
        if took is not None:
            took[:] = seconds
        for r in results:
            if isinstance(r, Exception) and not isinstance(r, EnvError):
                raise r
        return results

    def close_episode(self, episode: int) -> None:
        """Drop the episode's instance (never raises; an unknown or lost episode is a no-op)."""
        home = self._drop(episode)
        if home is None or home[1] is None:
            return
        j, w = home
        with self._slot_locks[j]:
            if self._pool and self._pool[j] is w:
                w.send_close(episode)

    def close(self) -> None:
        """End every worker (EOF, then its process group is killed) and drop every episode; idempotent."""
        self._closed = True
        pool, self._pool = self._pool, []
        close_all([w.child for w in pool], CLOSE_GRACE_S)
        with self._lock:
            self._envs.clear()
            self._episode_locks.clear()
            self._home.clear()

    def __enter__(self) -> EnvRunner:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------- internals

    def _payload(self, episode: int, op: str, arg: Any) -> str | None:
        if op not in OPS:
            raise ValueError(f"unknown environment call {op!r}; expected one of {OPS}")
        if not self.workers:
            return None
        msg: dict[str, Any] = {"op": op, "episode": episode}
        if op != "reset":
            msg["row" if op == "open" else "completion"] = arg
        try:
            return json.dumps(msg)
        except (TypeError, ValueError) as e:
            raise InputError(
                f"--env-workers {self.workers} sends each data row to the environment workers as JSON, and the row "
                f"of episode {episode} is not JSON ({e}): make its columns JSON values or use --env-workers 0"
            ) from None

    def _route(self, episode: int, op: str) -> int:
        """The worker slot of ``episode``; ``open`` picks the least loaded one (-1: in process)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("EnvRunner is closed")
            if not self.workers:  # checked when the call runs (an open may precede it in the same call_many)
                return -1
            known = episode in self._home
            if op == "open" and known:
                raise ValueError(f"episode {episode} is already open; close_episode() it first")
            if op != "open" and not known:
                raise ValueError(f"episode {episode} is not open; call open(episode, row) first")
            if op == "open":
                j = min(range(self.workers), key=self._load.__getitem__)
                self._home[episode], self._load[j] = (j, None), self._load[j] + 1
            return self._home[episode][0]

    def _run(self, j: int, episode: int, op: str, payload: str | None, arg: Any, deadline: float = math.inf) -> Any:
        with heartbeat.working("environment", call=op, episode=episode):  # progress for the watchdog
            return self._run_call(j, episode, op, payload, arg, deadline)

    def _bound(self, episode: int, op: str, deadline: float) -> tuple[float, bool]:
        """The call's timeout as it starts: ``--env-timeout-s``, or what is left of the group's deadline when that is
        sooner (then True); ``EnvEvicted`` when nothing is left."""
        if deadline == math.inf:
            return self.timeout_s, False
        left = deadline - time.monotonic()
        if left <= 0:
            raise EnvEvicted(f"{op}() of episode {episode}: {_past(deadline)} (never started)")
        return (left, True) if not self.timeout_s or left < self.timeout_s else (self.timeout_s, False)

    def _run_call(self, j: int, episode: int, op: str, payload: str | None, arg: Any, deadline: float) -> Any:
        if j < 0:
            lock = self._call_lock if not self.concurrent else self._episode_lock(episode)
            # bounded by the deadline: a call abandoned at an earlier deadline may hold the lock for good
            if not lock.acquire(timeout=-1 if deadline == math.inf else max(0.0, deadline - time.monotonic())):
                raise EnvEvicted(f"{op}() of episode {episode}: {_past(deadline)} (waiting for the environment)")
            try:
                if (episode in self._envs) != (op != "open"):
                    raise ValueError(f"episode {episode} is {'already' if op == 'open' else 'not'} open")
                timeout_s, cut = self._bound(episode, op, deadline)
                try:
                    return _apply(self._envs, self.cls, op, episode, arg, timeout_s)
                except EnvTimeout:
                    if cut:
                        raise EnvEvicted(f"{op}() of episode {episode}: {_past(deadline)} (cut)") from None
                    raise
            finally:
                lock.release()
        what = f"{'the constructor' if op == 'open' else op + '()'} of episode {episode}"
        with self._slot_locks[j]:
            w = self._pool[j] if self._pool else None
            with self._lock:
                home = self._home.get(episode)
                if home is not None and op == "open":
                    self._home[episode] = home = (j, w)
            if w is None or home is None or home[1] is None:
                raise ValueError(f"episode {episode} is not open (closed meanwhile, or the runner is closed)")
            if home[1] is not w:
                raise EnvError(
                    f"episode {episode}: the worker was replaced ({home[1].lost}), and the episode's state went with it"
                )
            try:
                timeout_s, cut = self._bound(episode, op, deadline)
                value = w.request(payload, timeout_s, what)
            except EnvError as e:
                if w.lost is not None and self._pool and not self._closed:
                    self._pool[j] = _Worker(self.spec)
                if op == "open":
                    self._drop(episode)
                if isinstance(e, EnvTimeout) and cut:  # the worker was killed at the deadline, and replaced
                    raise EnvEvicted(f"{what}: {_past(deadline)} (cut; its worker was killed and replaced)") from None
                raise
        return Step(**value) if op == "step" else value

    def _episode_lock(self, episode: int) -> threading.Lock:
        """The lock of one episode's calls (a concurrent class in process): other episodes' calls do not wait."""
        with self._lock:
            return self._episode_locks.setdefault(episode, threading.Lock())

    def _drop(self, episode: int) -> tuple[int, _Worker | None] | None:
        with self._lock:
            self._envs.pop(episode, None)
            self._episode_locks.pop(episode, None)
            home = self._home.pop(episode, None)
            if home is not None:
                self._load[home[0]] -= 1
        return home


def _past(deadline: float) -> str:
    from align.rollout.deadlines import past_deadline

    return past_deadline(deadline)


# ------------------------------------------------------------------------------------------------ the worker side


def _worker_main() -> None:
    """A worker: JSON lines in on stdin, replies out on the original stdout (the environment's prints go to stderr,
    and its reads of stdin see an empty file)."""
    from align.rollout.process import exit_with_parent

    inp, out = child_stdio()
    exit_with_parent(os.getppid(), grace_s=0)  # a trainer gone (even by SIGKILL) takes a hung worker's group with it
    spec = json.loads(inp.readline())["spec"]
    try:
        cls = load_env_class(spec)
    except Exception:  # noqa: BLE001 -- reported to the trainer, which raises it as the call's EnvError
        out.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        return
    out.write(json.dumps({"ready": True}) + "\n")
    envs: dict[int, tuple[Any, dict]] = {}
    for line in inp:
        msg = json.loads(line)
        call = msg["call"]
        op, episode = call["op"], call["episode"]
        if op == "close":
            envs.pop(episode, None)
            continue
        try:
            value = _apply(envs, cls, op, episode, call.get("row", call.get("completion")), 0.0)
            reply = {"id": msg["id"], "ok": value._asdict() if isinstance(value, Step) else value}
        except EnvError as e:
            reply = {"id": msg["id"], "error": str(e)}
        try:
            text = json.dumps(reply)
        except (TypeError, ValueError) as e:
            text = json.dumps(
                {
                    "id": msg["id"],
                    "error": f"{op}() returned a value that is not JSON ({e}); with "
                    "--env-workers >= 1 it travels as JSON: use str, numbers, lists and dicts",
                }
            )
        out.write(text + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()
