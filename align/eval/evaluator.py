"""What the training loop drives: ``Evaluator`` (``baseline`` / ``step`` / ``poll`` / ``drain``) and ``make_evaluator``,
which picks the posture (seed ``000_...``): off, the blocking in-process eval, or snapshot eval on an
``EvalDispatcher`` (fleet or ``CheckpointEvalFn``). stdlib only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from align.eval.checkpoint_eval import CheckpointEvalFn, load_eval_fn
from align.eval.config import EvalConfig, EvalSet
from align.eval.dispatcher import EvalDispatcher, EvalRunner, Record, namespaced

logger = logging.getLogger(__name__)


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
            return [self._blocking(step)]
        return []

    def _blocking(self, step: int) -> Record:
        t0 = time.perf_counter()
        metrics = namespaced(self.blocking_eval_fn(step))
        dt = time.perf_counter() - t0
        return {
            "step": step,
            **metrics,
            "eval/step": step,
            "eval/duration_seconds": dt,
            "eval/train_blocked_seconds": dt,
        }

    def baseline(self, hf_dir: str, *, written: Sequence[Record] = (), resumed: bool = False) -> list[Record]:
        """The step-0 point: the base checkpoint ``hf_dir`` (caller-owned: no export, no marker gate, never GC'd),
        through the same path as every other point (snapshot posture: dispatched, non-blocking; blocking posture:
        the in-process eval of the live, still untrained, policy).

        Written once per run: nothing happens when ``written`` (the run's metrics so far) already holds a step-0
        eval record. A resumed run whose baseline never landed (killed while it ran) evaluates it now in the
        snapshot posture; the blocking posture cannot (the live policy is no longer the base weights), but there
        the baseline always finishes before step 1."""
        if self.cfg.eval_interval <= 0 or any(r.get("step") == 0 and "eval/step" in r for r in written):
            return []
        if self.dispatcher is None:
            return [] if resumed or self.blocking_eval_fn is None else [self._blocking(0)]
        self.dispatcher.dispatch(0, hf_dir=str(hf_dir))
        return self.dispatcher.poll()

    def poll(self) -> list[Record]:
        return self.dispatcher.poll() if self.dispatcher is not None and not self._drained else []

    def drain(self, after_error: BaseException | None = None) -> list[Record]:
        """Settle every pending point, release the backend, return the last records. Idempotent (then ``[]``).

        ``after_error``: the exception that is ending the run (call ``drain`` from the loop's ``finally``). A drain
        failure (e.g. a ``--ci-test`` skip) then never replaces it: it is logged and added to that exception as a
        note, and ``after_error`` stays the one that propagates."""
        if self._drained or self.dispatcher is None:
            self._drained = True
            return []
        self._drained = True
        try:
            try:
                return self.dispatcher.drain()
            finally:
                self.dispatcher.close()
        except Exception as e:
            if after_error is None:
                raise
            logger.error("eval drain failed while the run was already failing: %s", e)
            note = f"(also, draining the evaluator failed: {type(e).__name__}: {e})"
            if hasattr(after_error, "add_note"):  # Python >= 3.11 prints notes with the traceback
                after_error.add_note(note)
            else:
                after_error.__notes__ = [*getattr(after_error, "__notes__", []), note]
            return self.dispatcher._take_records()


def make_evaluator(
    cfg: EvalConfig,
    eval_set: EvalSet | None,
    *,
    export_fn: Callable[[str], None] | None,
    blocking_eval_fn: Callable[[int], dict] | None,
    fleet: Any = None,
    eval_fn: CheckpointEvalFn | None = None,
    should_stop: Callable[[], bool] | None = None,
    reserved_gpus: Sequence[Any] = (),
    run_id: str | None = None,
) -> Evaluator:
    """Build the evaluator for ``cfg``'s posture.

    Snapshot eval (``eval_num_gpus > 0`` or ``eval_function_path``): an ``EvalDispatcher`` on its daemon loop with
    an ``EvalRunner`` over the fleet (spawned lazily on the first point, off the training loop) or the loaded
    ``CheckpointEvalFn``. Otherwise the blocking ``blocking_eval_fn(step) -> metrics`` runs in the loop.
    ``fleet`` / ``eval_fn`` inject a ready backend (tests, or a fleet shared across runs). ``should_stop``: see
    ``EvalDispatcher``. ``reserved_gpus``: GPUs (absolute ``CUDA_VISIBLE_DEVICES`` ids) the run already uses, e.g.
    ``--rollout-gpu``; a fleet plan that overlaps them, or needs GPUs that are not visible, is a ``ValueError`` here.
    ``run_id``: the run's id, written into every eval snapshot (see ``EvalDispatcher``).
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

            fleet = EvalFleet.from_config(cfg, reserved_gpus=reserved_gpus)
    runner = EvalRunner(cfg, eval_set, eval_fn=eval_fn, fleet=fleet)
    return Evaluator(cfg, dispatcher=EvalDispatcher(cfg, runner, export_fn, should_stop=should_stop, run_id=run_id))
