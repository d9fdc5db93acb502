"""Non-blocking eval dispatch: snapshot export, a bounded FIFO of pending evals, retention GC, drain. stdlib only.

Port of the miles ``EvalDispatcher`` (seed ``000_...``; ``shared/reference/eval-spec.md`` part A), with the seed's
threading model: the dispatcher owns a private event loop on a daemon thread and the synchronous training loop
drives it through ``Evaluator.step`` / ``poll`` / ``drain``.

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
``eval_keep_snapshots`` and deletes older ones. Dirs the dispatcher did not export are never deleted.
Every skipped point yields exactly one ``eval/skipped_{reason}`` record at its step; under ``ci_test`` the next
training-thread call (``dispatch`` / ``poll`` / ``drain``) raises ``RuntimeError`` for it.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from align.eval.checkpoint_eval import CheckpointEvalFn, EvalInput, EvalSkip, adapter_base_model, load_eval_fn
from align.eval.config import EvalConfig, EvalSet
from align.eval.metrics import score_eval_set
from align.rollout.protocol import fsync_dir

logger = logging.getLogger(__name__)

MARKER = ".complete"  # the commit marker, written last (same as align.model.COMMIT_MARKER)

Record = dict[str, Any]


def is_complete(path: str) -> bool:
    """True when ``path`` holds a committed snapshot (its marker exists)."""
    return os.path.isfile(os.path.join(path, MARKER))


def snapshot_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step}")



def export_snapshot(export_fn: Callable[[str], None], root: str, step: int) -> str:
    """Export via ``export_fn(tmp)`` and commit it at ``{root}/step_{step}``; on failure nothing is left behind.

    ``export_fn(path)`` writes an HF dir at ``path`` (e.g. ``align.model.save_pretrained``). If it wrote no
    marker, one is written here, after everything else; then the dir is renamed into place, replacing a stale
    ``step_{step}`` from an earlier run (moved aside first, so no old marker can vouch for new shards).
    """
    os.makedirs(root, exist_ok=True)
    final = snapshot_dir(root, step)
    tmp = os.path.join(root, f".step_{step}.partial-{uuid.uuid4().hex[:8]}")
    try:
        export_fn(tmp)
        if not os.path.isdir(tmp) or not os.listdir(tmp):
            raise RuntimeError(f"export_fn wrote nothing at {tmp}")
        marker = os.path.join(tmp, MARKER)
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                json.dump({"step": step}, f)
                f.flush()
                os.fsync(f.fileno())
        if os.path.exists(final):
            old = os.path.join(root, f".step_{step}.stale-{uuid.uuid4().hex[:8]}")
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
        self.latest_step = 0  # the training loop's newest step, for eval/lag_steps
        self._lock: asyncio.Lock | None = None

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
            if self.eval_fn is None:
                metrics = await run_in_daemon_thread(score_eval_set, self.eval_set, inp.sampling, state.generate)
            elif inspect.iscoroutinefunction(getattr(self.eval_fn, "evaluate_checkpoint", None)) or (
                inspect.iscoroutinefunction(self.eval_fn)
            ):
                metrics = await self.eval_fn(inp)
            else:
                metrics = await run_in_daemon_thread(self.eval_fn, inp)
                if inspect.isawaitable(metrics):
                    metrics = await metrics
        if not isinstance(metrics, dict):
            raise TypeError(f"eval function returned {type(metrics).__name__}, expected a dict of metrics")
        record: Record = {"step": step, **metrics, "eval/step": step}
        record["eval/lag_steps"] = max(self.latest_step - step, 0)
        record["eval/duration_seconds"] = time.perf_counter() - t0
        if export_time is not None:
            record["eval/export_time_seconds"] = export_time
        if blocked_s is not None:
            record["eval/train_blocked_seconds"] = blocked_s
        return record

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

    def __init__(self, cfg: EvalConfig, runner: EvalRunner, export_fn: Callable[[str], None] | None) -> None:
        if not cfg.eval_hf_dir:
            raise ValueError("EvalDispatcher needs --eval-hf-dir, the staging dir for eval snapshots")
        self.cfg, self.runner, self.export_fn = cfg, runner, export_fn
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
        if not self._call(self._admit(force)):
            self._report_skip(step, "busy")
            self._raise_ci()
            return
        exported_dir = None
        export_time = None
        if hf_dir is None:
            t0 = time.perf_counter()
            try:
                hf_dir = export_snapshot(self.export_fn, self.cfg.eval_hf_dir, step)
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
            self._call(self._drain())
        self._raise_ci()
        return self._take_records()

    def close(self) -> None:
        """Drain, dispose the backend (fleet workers, CheckpointEvalFn) and stop the loop. Idempotent."""
        if self._closed:
            return
        try:
            self._call(self._drain())
        finally:
            self._closed = True
            try:
                self.runner.dispose()
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)

    # ---- loop side ----

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

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
            self._report_skip(step, e.reason)
        except Exception:
            logger.exception("Async eval for step %d raised", step)
            self._report_skip(step, "crashed")
        else:
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
            if self.cfg.ci_test:
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


class Evaluator:
    """What the training loop drives. ``step`` after each optimizer step, ``poll`` any time, ``drain`` at the end.

    Each call returns the eval records finished since the previous call (each record exactly once), every one
    stamped ``"step": N`` with the step whose weights it measured; write them to ``metrics.jsonl`` at that step.
    """

    def __init__(
        self,
        cfg: EvalConfig,
        *,
        dispatcher: EvalDispatcher | None = None,
        blocking_eval_fn: Callable[[int], dict] | None = None,
    ) -> None:
        self.cfg, self.dispatcher, self.blocking_eval_fn = cfg, dispatcher, blocking_eval_fn
        self._drained = False

    @property
    def posture(self) -> str:
        """``off`` (no eval interval), ``blocking`` (in-process eval in the loop) or ``snapshot``."""
        if self.cfg.eval_interval <= 0:
            return "off"
        return "snapshot" if self.dispatcher is not None else "blocking"

    def step(self, step: int, is_final: bool = False) -> list[Record]:
        """Call after optimizer step ``step`` (1-based). Runs the eval point if one is due, then returns."""
        if self._drained:
            raise RuntimeError("Evaluator.step after drain(); drain() is the last call of a run")
        if self.dispatcher is not None:
            self.dispatcher.runner.latest_step = max(self.dispatcher.runner.latest_step, step)
            if self.cfg.is_due(step, is_final):
                self.dispatcher.dispatch(step, force=is_final)
            return self.dispatcher.poll()
        if self.cfg.is_due(step, is_final) and self.blocking_eval_fn is not None:
            t0 = time.perf_counter()
            metrics = self.blocking_eval_fn(step)
            dt = time.perf_counter() - t0
            return [
                {
                    "step": step,
                    **metrics,
                    "eval/step": step,
                    "eval/duration_seconds": dt,
                    "eval/train_blocked_seconds": dt,
                }
            ]
        return []

    def baseline(self, hf_dir: str) -> list[Record]:
        """Evaluate a caller-owned checkpoint (the base model) as step 0: no export, no marker gate, never GC'd."""
        if self.dispatcher is None:
            return self.step(0, is_final=False) if self.cfg.eval_interval > 0 else []
        self.dispatcher.dispatch(0, hf_dir=hf_dir)
        return self.dispatcher.poll()

    def poll(self) -> list[Record]:
        return self.dispatcher.poll() if self.dispatcher is not None and not self._drained else []

    def drain(self) -> list[Record]:
        """Settle every pending point, release the backend, return the last records. Idempotent (then ``[]``)."""
        if self._drained or self.dispatcher is None:
            self._drained = True
            return []
        self._drained = True
        try:
            records = self.dispatcher.drain()
        finally:
            self.dispatcher.close()
        return records


def make_evaluator(
    cfg: EvalConfig,
    eval_set: EvalSet | None,
    *,
    export_fn: Callable[[str], None] | None,
    blocking_eval_fn: Callable[[int], dict] | None,
    fleet: Any = None,
    eval_fn: CheckpointEvalFn | None = None,
) -> Evaluator:
    """Build the evaluator for ``cfg``'s posture.

    Snapshot eval (``eval_num_gpus > 0`` or ``eval_function_path``): an ``EvalDispatcher`` on its daemon loop with
    an ``EvalRunner`` over the fleet (spawned lazily on the first point, off the training loop) or the loaded
    ``CheckpointEvalFn``. Otherwise the blocking ``blocking_eval_fn(step) -> metrics`` runs in the loop.
    ``fleet`` / ``eval_fn`` inject a ready backend (tests, or a fleet shared across runs).
    """
    if cfg.eval_interval <= 0:
        return Evaluator(cfg)
    if not cfg.uses_snapshots:
        if blocking_eval_fn is None:
            raise ValueError(
                "--eval-interval is set without --eval-num-gpus or --eval-function-path, so eval is the blocking "
                "in-process eval, but no blocking_eval_fn was given"
            )
        return Evaluator(cfg, blocking_eval_fn=blocking_eval_fn)
    if eval_set is None:
        raise ValueError("snapshot eval needs an eval set (--eval-interval is set but no EvalSet was given)")
    if export_fn is None:
        raise ValueError("snapshot eval needs export_fn(path), which writes an HF snapshot of the current weights")
    if eval_fn is None and fleet is None:
        if cfg.eval_function_path:
            eval_fn = load_eval_fn(cfg.eval_function_path, cfg, eval_set)
        else:
            from align.eval.fleet import EvalFleet

            fleet = EvalFleet.from_config(cfg)
    runner = EvalRunner(cfg, eval_set, eval_fn=eval_fn, fleet=fleet)
    return Evaluator(cfg, dispatcher=EvalDispatcher(cfg, runner, export_fn))
