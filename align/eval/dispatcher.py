"""Non-blocking eval dispatch: snapshot export, a bounded FIFO of pending evals, retention GC, drain. stdlib only.

Port of the miles ``EvalDispatcher`` (seed ``000_...``; radixark/miles ``miles/ray/rollout/eval_dispatch.py``),
with the seed's threading model: the dispatcher owns a private event loop on a daemon thread and the synchronous
training loop drives it through ``Evaluator.step`` / ``poll`` / ``drain``.

One eval point (``EvalDispatcher.dispatch(step)``), on the training thread:

1. reap settled points (FIFO); if ``eval_max_in_flight`` are pending, ``backpressure`` waits for the oldest and
   ``skip`` drops the point as ``busy`` *before* exporting (``force``, the final step, always waits);
2. export the current weights with ``export_fn`` into a temporary dir under ``eval_hf_dir``, commit it with the
   ``.complete`` marker and rename it to ``{eval_hf_dir}/step_{N}``; a failed export removes its partial dir and
   skips as ``export_failed``. The export runs on the training thread, so the snapshot is the weights at ``N``
   (invariant I1) and multi-rank exports stay collective;
3. fire the eval on the loop and return. The ``EvalRunner`` runs points one at a time in dispatch order (one
   ``asyncio.Lock``): marker gate (``ckpt_missing``), fleet pin (``pin_violation`` / ``unhealthy``), the eval
   function (``EvalSkip(reason)``, anything else ``crashed``). Blocking work runs on daemon worker threads, so
   neither the loop nor interpreter exit waits on a hung backend.

Every settled exported snapshot enters the retention ring exactly once, whatever its outcome; the ring keeps
``eval_keep_snapshots`` and deletes older ones. Each snapshot carries the run's id (``.align-export.json``,
``align.atomic.write_export_marker``): a ``step_N`` whose marker does not name this run is never replaced
(``export_failed``) nor deleted by the ring. Dirs the dispatcher did not export are never deleted, except
leftovers of crashed predecessors of this run (named with its id) under our own names, removed at startup
(``clean_leftovers``).
A ``CheckpointEvalFn`` call is bounded by ``eval_timeout_s`` (then ``timeout``); once ``should_stop()`` (a signal)
no training-thread call waits on an eval for long (``interrupted``).
Every skipped point yields exactly one ``eval/skipped_{reason}`` record at its step; under ``ci_test`` the next
training-thread call (``dispatch`` / ``poll`` / ``drain``) raises ``RuntimeError`` for it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import fcntl
import glob
import inspect
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from align import heartbeat
from align.atomic import COMMIT_MARKER, export_owner, fsync_dir, write_export_marker
from align.eval.checkpoint_eval import CheckpointEvalFn, EvalInput, EvalSkip, adapter_base_model
from align.eval.config import EvalConfig, EvalSet
from align.eval.metrics import score_eval_set

logger = logging.getLogger(__name__)

STOP_POLL_S = 0.2  # how often a blocked training-thread call checks should_stop()
STOP_GRACE_S = 10.0  # after a stop request, how long drain() still waits for pending points before abandoning them
UNATTRIBUTED = ("interrupted",)  # skip reasons that are the user's stop, not an eval failure (never fail --ci-test)

Record = dict[str, Any]


def is_complete(path: str) -> bool:
    """True when ``path`` holds a committed snapshot (its marker exists)."""
    return os.path.isfile(os.path.join(path, COMMIT_MARKER))


def snapshot_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step}")


def namespaced(metrics: dict) -> Record:
    """An eval function's metrics with every key under ``eval/``: they can never overwrite ``step`` or a training
    key of the same record (``loss`` becomes ``eval/loss``; ``eval/pass@1`` stays)."""
    return {k if str(k).startswith("eval/") else f"eval/{k}": v for k, v in metrics.items()}


def _temp_name(step: int, kind: str, run_id: str) -> str:
    """A temporary beside ``step_{step}`` (``kind``: ``partial`` = an export not yet committed, ``stale`` = a
    replaced snapshot not yet removed), named with the run that made it so that only that run removes it."""
    return f".step_{step}.{kind}-{run_id}-{uuid.uuid4().hex[:8]}"


_TEMP = re.compile(r"\.step_\d+\.(?:partial|stale)-(?P<run_id>.+)-[0-9a-f]{8}")


def clean_leftovers(root: str, run_id: str) -> list[str]:
    """Delete what crashed predecessors left under ``root`` (only our own names); returns what was removed.

    ``.step_N.partial-{run_id}-*`` (an export that never committed) and ``.step_N.stale-{run_id}-*`` (a replaced
    snapshot not yet removed) of this run only: another run sharing ``--eval-hf-dir`` may be exporting right now.
    ``fleet-*`` dirs (fleet spools and logs) whose workers are gone: a fleet dir whose spool lock a live worker still
    holds is kept. Committed ``step_N`` snapshots are left alone (replaced by name when that step is exported
    again)."""
    removed = []
    pats = (".step_*.partial-*", ".step_*.stale-*", "fleet-*")
    for path in sorted(p for pat in pats for p in glob.glob(os.path.join(glob.escape(root), pat))):
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        name = os.path.basename(path)
        if name.startswith("fleet-"):
            if _fleet_in_use(path):
                continue
        elif (m := _TEMP.fullmatch(name)) is None or m["run_id"] != run_id:
            continue  # another run's temporary (or not one of ours at all)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d leftover(s) of an earlier run under %s: %s", len(removed), root, removed)
    return removed


def _fleet_in_use(fleet_root: str) -> bool:
    for lock in glob.glob(os.path.join(glob.escape(fleet_root), "engine_*", "worker.lock")):
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            return True  # a live worker holds it
        finally:
            os.close(fd)
    return False


def _check_replaceable(final: str, run_id: str) -> None:
    if (os.path.exists(final) or os.path.islink(final)) and export_owner(final) != run_id:
        raise RuntimeError(
            f"{final} exists and is not a snapshot of this run (its .align-export.json names run "
            f"{export_owner(final)}, this run is {run_id}); refusing to replace it"
        )


def export_snapshot(export_fn: Callable[[str], None], root: str, step: int, run_id: str | None = None) -> str:
    """Export via ``export_fn(tmp)`` and commit it at ``{root}/step_{step}``; on failure nothing is left behind.

    ``export_fn(path)`` writes an HF dir at ``path`` (e.g. ``align.model.save_pretrained``). If it wrote no
    marker, one is written here, after everything else, and the run's marker (``run_id``; None: a fresh one) after
    it; then the dir is renamed into place, replacing a stale ``step_{step}`` only when its marker names the same
    run (moved aside first, so no old marker can vouch for new shards); anything else is RuntimeError. Both
    temporaries (``.step_N.partial-{run_id}-*``, ``.step_N.stale-{run_id}-*``) carry the run id: a killed export's
    are removed by the next start of the same run (``clean_leftovers``), never by another run.
    """
    run_id = run_id or uuid.uuid4().hex
    os.makedirs(root, exist_ok=True)
    final = snapshot_dir(root, step)
    _check_replaceable(final, run_id)  # before the export's work
    tmp = os.path.join(root, _temp_name(step, "partial", run_id))
    try:
        export_fn(tmp)
        if not os.path.isdir(tmp) or not os.listdir(tmp):
            raise RuntimeError(f"export_fn wrote nothing at {tmp}")
        marker = os.path.join(tmp, COMMIT_MARKER)
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                json.dump({"step": step}, f)
                f.flush()
                os.fsync(f.fileno())
        write_export_marker(tmp, run_id, step)
        _check_replaceable(final, run_id)  # again: another process may have written it meanwhile
        if os.path.exists(final):
            old = os.path.join(root, _temp_name(step, "stale", run_id))
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


async def run_in_daemon_thread(fn: Callable, *args: Any) -> Any:
    """``asyncio.to_thread`` on a daemon thread: a hung backend call never blocks interpreter exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine, which re-raises it
            loop.call_soon_threadsafe(_settle_future, fut, None, e)
        else:
            loop.call_soon_threadsafe(_settle_future, fut, result, None)

    threading.Thread(target=target, name=f"align-eval-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await fut


def _settle_future(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class EvalRunner:
    """The driver-owned executor of eval points (miles' ``_eval_checkpoint``): one point at a time, in order.

    Per point, under one lock: marker gate, fleet pin (the fleet hands back a pinned ``generate_state``), then the
    eval: ``eval_fn(EvalInput)`` when a ``CheckpointEvalFn`` is configured, else the stock eval set scored on the
    pinned fleet. Returns the metrics record; raises ``EvalSkip`` for an attributable skip.
    """

    def __init__(
        self,
        cfg: EvalConfig,
        eval_set: EvalSet,
        *,
        eval_fn: CheckpointEvalFn | Callable[[EvalInput], Any] | None = None,
        fleet: Any = None,
    ) -> None:
        if (eval_fn is None) == (fleet is None):
            raise ValueError("EvalRunner needs exactly one backend: a CheckpointEvalFn or an eval fleet")
        self.cfg, self.eval_set, self.eval_fn, self.fleet = cfg, eval_set, eval_fn, fleet
        self.part = "eval function" if fleet is None else "eval fleet"  # what a stall waiting on it names
        self.latest_step = 0  # the training loop's newest step, for eval/lag_steps
        self._lock: asyncio.Lock | None = None
        self._abandoned: asyncio.Future | None = None  # an eval function call that timed out and still runs

    async def run(
        self, step: int, hf_dir: str, *, require_marker: bool, export_time: float | None, blocked_s: float | None = None
    ) -> Record:
        if self._lock is None:
            self._lock = asyncio.Lock()  # created on the dispatcher loop, FIFO-fair
        t0 = time.perf_counter()
        async with self._lock:
            if require_marker and not is_complete(hf_dir):
                logger.warning("Eval snapshot %s missing or incomplete, skipping eval %d", hf_dir, step)
                raise EvalSkip("ckpt_missing")
            state = None
            if self.fleet is not None:
                state = await run_in_daemon_thread(self.fleet.pin, hf_dir, step)
            inp = EvalInput(
                step=step,
                weight_version=step,
                hf_dir=hf_dir,
                eval_set=self.eval_set,
                sampling=self.cfg.sampling_for(self.eval_set),
                config=self.cfg,
                generate_state=state,
                export_time_seconds=export_time,
                base_model=adapter_base_model(hf_dir),
            )
            if self.eval_fn is None:  # every fleet operation has its own --eval-timeout-s (spool client)
                metrics = await run_in_daemon_thread(score_eval_set, self.eval_set, inp.sampling, state.generate)
            else:
                metrics = await self._call_eval_fn(inp)
        if not isinstance(metrics, dict):
            raise TypeError(f"eval function returned {type(metrics).__name__}, expected a dict of metrics")
        record: Record = {"step": step, **namespaced(metrics), "eval/step": step}
        record["eval/lag_steps"] = max(self.latest_step - step, 0)
        record["eval/duration_seconds"] = time.perf_counter() - t0
        if export_time is not None:
            record["eval/export_time_seconds"] = export_time
        if blocked_s is not None:
            record["eval/train_blocked_seconds"] = blocked_s
        return record

    async def _call_eval_fn(self, inp: EvalInput) -> Any:
        """The eval function, bounded by ``--eval-timeout-s``: past it the point is ``EvalSkip("timeout")`` and the
        call is abandoned (its daemon thread runs on). The next point first waits for an abandoned call within its
        own timeout, so the eval function is never entered twice at once."""
        timeout = self.cfg.eval_timeout_s
        deadline = time.monotonic() + timeout
        if self._abandoned is not None and not self._abandoned.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._abandoned), timeout)
            except asyncio.TimeoutError:
                raise EvalSkip("timeout", f"an earlier eval call still runs after {timeout:g} s more") from None
            except Exception as e:  # noqa: BLE001 - that call's point was already reported as timed out
                logger.info("the eval call that timed out earlier ended with %s", e)
        fn = self.eval_fn
        is_async = inspect.iscoroutinefunction(getattr(fn, "evaluate_checkpoint", None)) or (
            inspect.iscoroutinefunction(fn)
        )

        async def invoke() -> Any:
            if is_async:
                return await fn(inp)
            out = await run_in_daemon_thread(fn, inp)
            return await out if inspect.isawaitable(out) else out

        fut = asyncio.ensure_future(invoke())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            self._abandoned = fut
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" noise
            logger.error("eval %d: the eval function did not return within --eval-timeout-s %g", inp.step, timeout)
            raise EvalSkip("timeout", f"no result within --eval-timeout-s {timeout:g}") from None

    def dispose(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
        if isinstance(self.eval_fn, CheckpointEvalFn):
            self.eval_fn.dispose()


@dataclass
class _Point:
    step: int
    task: asyncio.Task
    exported_dir: str | None


class EvalDispatcher:
    """Bounded, FIFO, non-blocking dispatch of snapshot evals (see the module docstring).

    ``dispatch``, ``poll``, ``drain`` and ``close`` are called from the training thread; ``pending`` and the
    retention ring are touched only on the dispatcher's own loop.
    """

    def __init__(
        self,
        cfg: EvalConfig,
        runner: EvalRunner,
        export_fn: Callable[[str], None] | None,
        *,
        should_stop: Callable[[], bool] | None = None,
        run_id: str | None = None,
    ) -> None:
        """``should_stop()``: True once the run was asked to stop (a signal). Then no training-thread call waits on
        an eval: a backpressure wait gives up (the point is ``eval/skipped_interrupted``) and ``drain`` waits at most
        ``STOP_GRACE_S`` before abandoning the points still running (also ``interrupted``). ``run_id``: written into
        every snapshot; only snapshots carrying it are replaced or deleted (None: a fresh id, this process's own)."""
        if not cfg.eval_hf_dir:
            raise ValueError("EvalDispatcher needs --eval-hf-dir, the staging dir for eval snapshots")
        self.cfg, self.runner, self.export_fn = cfg, runner, export_fn
        self.part = getattr(runner, "part", "eval backend")  # what a stall of the trainer waiting on it names
        self.should_stop = should_stop or (lambda: False)
        self.run_id = run_id or uuid.uuid4().hex
        clean_leftovers(cfg.eval_hf_dir, self.run_id)
        self._abandoned: set[int] = set()  # steps given up at a stop; their late outcome is dropped
        self.pending: collections.deque[_Point] = collections.deque()
        self.exported: list[str] = []  # the retention ring: settled exported dirs, oldest first
        self._records: list[Record] = []
        self._ci_failures: list[str] = []
        self._mutex = threading.Lock()  # guards _records / _ci_failures (written on the loop, read on the caller)
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="align-eval-dispatcher", daemon=True)
        self._thread.start()

    # ---- training-thread API ----

    def dispatch(self, step: int, *, hf_dir: str | None = None, force: bool = False) -> None:
        """Run eval point ``step``: returns once its snapshot is exported and the eval fired, or it was skipped.

        ``hf_dir``: evaluate this caller-owned dir instead of exporting (e.g. the base checkpoint at step 0); it
        bypasses the marker gate and is never deleted. ``force``: never drop this point (the final step).
        """
        if self._closed:
            raise RuntimeError("EvalDispatcher.dispatch after close(); the evaluator was already drained")
        self._raise_ci()
        t_enter = time.perf_counter()
        self.runner.latest_step = max(self.runner.latest_step, step)
        try:  # behind a full queue the trainer waits on the eval backend: a stall there names it (safe point)
            with heartbeat.working(self.part, safe_point=True, step=step, wait="--eval-max-in-flight"):
                admitted = self._call(self._admit(force), interruptible=True)
        except _Interrupted:
            self._report_skip(step, "interrupted")
            return
        if not admitted:
            self._report_skip(step, "busy")
            self._raise_ci()
            return
        exported_dir = None
        export_time = None
        if hf_dir is None:
            t0 = time.perf_counter()
            try:
                hf_dir = export_snapshot(self.export_fn, self.cfg.eval_hf_dir, step, self.run_id)
            except Exception as e:  # noqa: BLE001 - any export failure skips the point, attributed and logged
                logger.error("HF snapshot export for eval %d failed: %s", step, e)
                self._report_skip(step, "export_failed")
                self._raise_ci()
                return
            export_time = time.perf_counter() - t0
            exported_dir = hf_dir
        blocked_s = time.perf_counter() - t_enter  # what this point cost the training loop: backpressure + export
        self._call(self._fire(step, hf_dir, exported_dir, export_time, blocked_s))

    def poll(self) -> list[Record]:
        """Records (metrics or skips) finished since the last call; raises under ``ci_test`` if one was a skip."""
        self._raise_ci()
        return self._take_records()

    def drain(self) -> list[Record]:
        """Settle every pending point (FIFO) and return the remaining records. Idempotent."""
        if not self._closed:
            self._wait_drain()
        self._raise_ci()
        return self._take_records()

    def close(self) -> None:
        """Drain, dispose the backend (fleet workers, CheckpointEvalFn) and stop the loop. Idempotent."""
        if self._closed:
            return
        try:
            self._wait_drain()
        finally:
            self._closed = True
            try:
                self.runner.dispose()
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)

    # ---- loop side ----

    def _call(self, coro, *, interruptible: bool = False) -> Any:
        """Run ``coro`` on the loop and wait for it; ``interruptible``: raise ``_Interrupted`` (and cancel it) as
        soon as ``should_stop()`` is true."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:
            try:
                return fut.result(timeout=STOP_POLL_S)
            except concurrent.futures.TimeoutError:
                if interruptible and self.should_stop():
                    fut.cancel()
                    raise _Interrupted from None

    def _wait_drain(self) -> None:
        """Settle every pending point; after a stop request, give them ``STOP_GRACE_S`` and abandon the rest."""
        with heartbeat.working(self.part, safe_point=True, wait="drain", pending=len(self.pending)):
            self._wait_drain_loop()

    def _wait_drain_loop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._drain(), self._loop)
        deadline = None
        while True:
            try:
                return fut.result(timeout=STOP_POLL_S)
            except concurrent.futures.TimeoutError:
                if not self.should_stop():
                    continue
                if deadline is None:
                    deadline = time.monotonic() + STOP_GRACE_S
                    logger.warning(
                        "stop requested: waiting up to %g s for %d pending eval point(s)",
                        STOP_GRACE_S,
                        len(self.pending),
                    )
                elif time.monotonic() >= deadline:
                    fut.cancel()
                    self._call(self._abandon())
                    return

    async def _abandon(self) -> None:
        for p in self.pending:
            if not p.task.done():
                self._abandoned.add(p.step)
                self._report_skip(p.step, "interrupted")
        self.pending.clear()

    def _reap(self) -> None:
        while self.pending and self.pending[0].task.done():
            self.pending.popleft()

    async def _admit(self, force: bool) -> bool:
        self._reap()
        while len(self.pending) >= self.cfg.eval_max_in_flight:
            if self.cfg.eval_overflow_policy == "skip" and not force:
                return False
            await asyncio.wait({self.pending[0].task})  # backpressure: only the oldest
            self._reap()
        return True

    async def _fire(
        self, step: int, hf_dir: str, exported_dir: str | None, export_time: float | None, blocked_s: float
    ) -> None:
        require_marker = exported_dir is not None
        task = asyncio.ensure_future(self._settle(step, hf_dir, exported_dir, require_marker, export_time, blocked_s))
        task.add_done_callback(lambda _t: self._reap())
        self.pending.append(_Point(step, task, exported_dir))
        assert len(self.pending) <= self.cfg.eval_max_in_flight, "pending exceeded eval_max_in_flight"

    async def _settle(
        self,
        step: int,
        hf_dir: str,
        exported_dir: str | None,
        require_marker: bool,
        export_time: float | None,
        blocked_s: float | None = None,
    ) -> None:
        try:
            record = await self.runner.run(
                step, hf_dir, require_marker=require_marker, export_time=export_time, blocked_s=blocked_s
            )
        except EvalSkip as e:
            if step not in self._abandoned:
                self._report_skip(step, e.reason)
        except Exception:
            logger.exception("Async eval for step %d raised", step)
            if step not in self._abandoned:
                self._report_skip(step, "crashed")
        else:
            if step in self._abandoned:
                logger.info("eval %d finished after it was abandoned at a stop; its record is dropped", step)
                return
            logger.info("eval %d: %s", step, {k: v for k, v in record.items() if k.startswith("eval/")})
            with self._mutex:
                self._records.append(record)
        finally:
            self._retire(exported_dir)

    def _retire(self, exported_dir: str | None) -> None:
        if exported_dir is None:
            return
        self.exported.append(exported_dir)
        while len(self.exported) > self.cfg.eval_keep_snapshots:
            victim = self.exported.pop(0)
            if export_owner(victim) != self.run_id:  # replaced since this run exported it: not ours to delete
                logger.warning(
                    "eval snapshot %s is no longer this run's (owner %s): not deleting it", victim, export_owner(victim)
                )
                continue
            shutil.rmtree(victim, ignore_errors=True)
            logger.info("GC'd consumed eval snapshot %s", victim)

    async def _drain(self) -> None:
        while self.pending:
            await asyncio.wait({self.pending[0].task})
            self._reap()

    # ---- records and skips ----

    def _report_skip(self, step: int, reason: str) -> None:
        logger.warning("eval %d skipped: %s", step, reason)
        with self._mutex:
            self._records.append({"step": step, f"eval/skipped_{reason}": 1, "eval/step": step})
            if self.cfg.ci_test and reason not in UNATTRIBUTED:
                self._ci_failures.append(f"CI eval {step} skipped: {reason}")

    def _take_records(self) -> list[Record]:
        with self._mutex:
            out, self._records = self._records, []
        return out

    def _raise_ci(self) -> None:
        with self._mutex:
            failures, self._ci_failures = self._ci_failures, []
        if failures:
            raise RuntimeError("; ".join(failures) + " (--ci-test fails the run on any skipped eval point)")


class _Interrupted(Exception):
    """A training-thread wait given up because ``should_stop()`` became true."""
