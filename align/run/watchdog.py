"""The run's watchdog (``--stall-timeout-s``): a run that stops making progress ends, loudly, instead of idling.

The parts that complete work beat (``align.heartbeat``): a token of the native sampler, an answer of a rollout worker,
a reward call, an environment call, an optimizer step. When nothing beat for ``--stall-timeout-s`` seconds the
watchdog thread writes ``{out}/stall.txt`` (every thread's stack, the calls in flight with their ages and engines,
each part's last beat, the rollout worker's heartbeat where there is a spool), prints one line naming the part that
stopped and flags the stop (``stop_flag["stall"]``). Where the trainer thread waits at a safe point (the rollout
pipeline's waits, ``--max-async-steps`` K >= 1) it checkpoints what is committed (as for a signal) and the run exits
with ``STALL_EXIT``; where the trainer thread itself is in the stuck call (K = 0: the sampler, a reward or an
environment step on it) nothing can be saved safely, so the process exits with ``STALL_EXIT`` at once, leaving the
last committed checkpoint to resume from. Peers' hangs this answers: NeMo-RL #3488, SkyRL #1173, verl #5815, slime #2176.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align import heartbeat
from align.atomic import atomic_write_text
from align.run.cli import STALL_EXIT

log = logging.getLogger(__name__)

DEFAULT_STALL_S = 1800.0  # half an hour without a token, reward, environment step or optimizer step
MIN_STALL_S = 1.0  # the smallest --stall-timeout-s: a token of a small model on a busy CPU takes well under this
GRACE_S = 60.0  # how long a trainer thread at a safe point gets to checkpoint and return before the process exits


@dataclass
class WatchdogConfig:
    """The watchdog's and the group deadlines' section of ``TrainConfig`` (flat: ``--stall-timeout-s``,
    ``--group-timeout-s``, ``--evict-policy``)."""

    stall_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "Watchdog: when no token, reward, environment step or optimizer step completes for this many "
            "seconds, write stall.txt in the run dir (thread stacks, calls in flight), checkpoint what is committed "
            f"and exit {STALL_EXIT} naming the part that stopped. None (default) = {DEFAULT_STALL_S:.0f} s, or the "
            f"largest per-call timeout if that is longer; 0 = off; else at least {MIN_STALL_S:.0f} s and at least "
            "every per-call timeout that is on (--reward-timeout-s, --env-timeout-s, --rollout-timeout-s with a "
            "spool worker, --eval-timeout-s with snapshot eval)."
        },
    )

    group_timeout_s: float = field(
        default=0.0,
        metadata={
            "help": "Group deadline: a group whose rewards are not all scored this many seconds after scoring began, "
            "whose environment calls take longer, or (spool worker) whose generation request is not answered within it "
            "is evicted (counted in rollout/evicted_groups, named in the completions log) and handled by "
            "--evict-policy; 0 = off. Needs --reward-workers 1. The native sampler's generation is the watchdog's."
        },
    )
    evict_policy: str = field(
        default="refill",
        metadata={
            "help": "An evicted group: 'refill' (its prompt is replaced by a fresh one from the data, within "
            "--max-refill-rounds; past them it trains masked) or 'mask' (its finished members train, the rest are "
            "unscorable)."
        },
    )

    def check_watchdog(self) -> None:
        """--stall-timeout-s: 0 or a finite number no smaller than one call may take by configuration; the group
        deadline's rules (``align.rollout.deadlines.check_deadline``). ``TrainConfig`` calls this."""
        from align.rollout.deadlines import check_deadline

        check_deadline(self)
        v = self.stall_timeout_s
        if v is None:
            return
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"--stall-timeout-s {v!r} is invalid: must be a finite number >= 0 (0 = off)")
        name, floor = self.stall_floor()
        if v and v < floor:
            raise ValueError(
                f"--stall-timeout-s {v!r} is invalid: below {name} ({floor} s), so one call the run allows would "
                f"count as a stall; use --stall-timeout-s >= {floor} (or lower {name}, or 0 to turn the watchdog off)"
            )

    def stall_floor(self) -> tuple[str, float]:
        """The longest one call may take by configuration, and the flag that sets it."""
        floors = {"the minimum": MIN_STALL_S}
        floors["--reward-timeout-s"] = self.rewards.reward_timeout_s
        floors["--env-timeout-s"] = self.envs.env_timeout_s
        if self.rollout != "native":  # one answer of a worker may take this long
            floors["--rollout-timeout-s"] = self.rollout_timeout_s
        if self.eval.uses_snapshots and self.eval.eval_interval > 0:  # the trainer may wait on one eval call (drain)
            floors["--eval-timeout-s"] = self.eval.eval_timeout_s
        return max(floors.items(), key=lambda kv: kv[1])

    @property
    def stall_after_s(self) -> float:
        """The watchdog's timeout in effect (0 = off): the flag, or by default the larger of DEFAULT_STALL_S and
        the longest call the configuration allows."""
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
        return max(DEFAULT_STALL_S, self.stall_floor()[1])


class Watchdog:
    """A daemon thread that watches ``align.heartbeat`` and ends a stalled run (see the module docstring).

    ``reports``: extra ``(title, fn)`` whose ``fn()`` is written to ``stall.txt`` (a worker's heartbeat)."""

    def __init__(self, out: Path, timeout_s: float, stop_flag: dict) -> None:
        self.out, self.timeout_s, self.stop_flag = Path(out), timeout_s, stop_flag
        self.prog = stop_flag.get("prog", "align")  # the CLI's name (``run_main`` sets it) for its one error line
        self.reports: list[tuple[str, Callable[[], Any]]] = []
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.trainer = threading.get_ident()  # the thread that runs the loop (it opened the run)

    @classmethod
    def for_run(cls, out: Path, timeout_s: float, stop_flag: dict, spool: Any = None) -> Watchdog:
        """The run's watchdog, started (``--stall-timeout-s``); a spool worker's heartbeat goes in stall.txt."""
        watchdog = cls(out, timeout_s, stop_flag)
        if spool is not None:
            watchdog.reports.append((f"rollout worker heartbeat ({spool.root})", spool.read_heartbeat))
        watchdog.start()
        return watchdog

    def start(self) -> None:
        if self.timeout_s <= 0:
            return
        heartbeat.reset()
        heartbeat.beat("start")
        self.thread = threading.Thread(target=self._watch, name="align-watchdog", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """The run ends (or stopped at a safe point): the watchdog stands down."""
        self.done.set()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self.done.wait(poll):
            last = heartbeat.last_progress()
            if last is not None and time.monotonic() - last >= self.timeout_s:
                self._fire(time.monotonic() - last)
                return

    def _fire(self, idle_s: float) -> None:
        line = self.describe(idle_s)
        path = self.out / "stall.txt"
        try:
            atomic_write_text(path, self.report(line))
        except OSError as e:  # the line still goes out
            line += f" (stall.txt not written: {e})"
        stuck = any(ident == self.trainer for *_, ident in heartbeat.snapshot()[1])
        if stuck:
            line += "; the trainer thread is in that call: exiting without a new checkpoint (resume from the last one)"
        print(f"{self.prog}: error: {line}", file=sys.stderr, flush=True)
        self.stop_flag["stall"] = line
        if not stuck:
            if self.done.wait(GRACE_S):  # the trainer stopped at a safe point, checkpointed and returned
                return
            print(
                f"{self.prog}: error: the trainer thread was not back at a safe point {GRACE_S:.0f} s after the "
                "stall: exiting without a new checkpoint (resume from the last one)",
                file=sys.stderr,
                flush=True,
            )
        logging.shutdown()
        os._exit(STALL_EXIT)

    def worker_stopped(self, err: BaseException) -> None:
        """A rollout worker found dead or stopped by its client (``WorkerDiedError``: its process exited, its
        heartbeat went stale, e.g. SIGSTOP, or no answer within --rollout-timeout-s) ends the run as a stall: the
        same ``stall.txt`` (the worker's heartbeat and log tail, the calls in flight, every stack) and one line naming
        the worker; the run exits with ``STALL_EXIT``. Its client notices sooner than --stall-timeout-s could (its
        heartbeat is rewritten every second: 30 s stale is a stopped worker), so this is the worker's watchdog."""
        if self.timeout_s <= 0 or self.stop_flag.get("stall"):
            return
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        line = (
            f"stalled: the rollout worker stopped ({first}); its log tail and thread stacks in {self.out / 'stall.txt'}"
        )
        try:
            atomic_write_text(self.out / "stall.txt", self.report(line) + f"\nthe client's error:\n{err}\n")
        except OSError as e:
            line += f" (stall.txt not written: {e})"
        print(f"{self.prog}: error: {line}", file=sys.stderr, flush=True)
        self.stop_flag["stall"] = line

    def describe(self, idle_s: float) -> str:
        """The one line: the part that stopped (the oldest call in flight), or the loop between parts."""
        _, calls = heartbeat.snapshot()
        now = time.monotonic()
        if calls:
            part, started, info, _ = calls[0]
            what = f"the {part} stopped (in a call for {now - started:.0f} s{_info(info)})"
        else:
            what = "the training loop stopped between parts (no call in flight)"
        return (
            f"stalled: no token, reward, environment step or optimizer step completed for {idle_s:.0f} s "
            f"(--stall-timeout-s {self.timeout_s:g}): {what}; thread stacks in {self.out / 'stall.txt'}"
        )

    def report(self, line: str) -> str:
        """``stall.txt``: the line, each part's last beat, the calls in flight, the extra reports, every stack."""
        last, calls = heartbeat.snapshot()
        now = time.monotonic()
        out = [line, "", "last progress per part (seconds ago):"]
        out += [f"  {p}: {now - t:.1f}" for p, t in sorted(last.items(), key=lambda kv: kv[1])]
        out += ["", f"calls in flight ({len(calls)}):"]
        out += [f"  {p}: for {now - t:.1f} s{_info(i)} ({_thread(ident)})" for p, t, i, ident in calls]
        for title, fn in self.reports:
            try:
                got = fn()
            except Exception as e:  # noqa: BLE001 - a report that fails is itself reported
                got = f"(failed: {e!r})"
            out += ["", f"{title}: {got}"]
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            out += ["", f"thread {names.get(ident, '?')} ({ident}):", "".join(traceback.format_stack(frame)).rstrip()]
        return "\n".join(out) + "\n"


def _thread(ident: int | None) -> str:
    return "the trainer waits here at a safe point" if ident is None else f"thread {ident}"


def _info(info: dict) -> str:
    return "".join(f", {k} {v}" for k, v in info.items())
