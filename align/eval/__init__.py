"""Non-blocking, snapshot-based evaluation (seed ``000_...``), each point pinned to one policy version (seed ``002_...``).

stdlib-only at import: the names below resolve lazily, so ``import align.eval`` costs nothing.

- ``EvalConfig`` / ``EvalSet``: the flags (``--eval-interval``, ``--eval-hf-dir``, ...) and what to evaluate.
- ``make_evaluator(cfg, eval_set, export_fn=..., blocking_eval_fn=...)``: the object the training loop drives
  (``step`` / ``poll`` / ``drain``).
- ``CheckpointEvalFn`` / ``EvalSkip`` / ``EvalInput``: evaluate snapshots on a backend the user owns.
- ``EvalDispatcher`` / ``EvalRunner`` / ``EvalFleet``: the machinery, see ``docs/eval.md``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EvalConfig": "align.eval.config",
    "EvalSet": "align.eval.config",
    "CheckpointEvalFn": "align.eval.checkpoint_eval",
    "EvalSkip": "align.eval.checkpoint_eval",
    "EvalInput": "align.eval.checkpoint_eval",
    "load_eval_fn": "align.eval.checkpoint_eval",
    "retarget_args": "align.eval.checkpoint_eval",
    "EvalDispatcher": "align.eval.dispatcher",
    "EvalRunner": "align.eval.dispatcher",
    "Evaluator": "align.eval.evaluator",
    "make_evaluator": "align.eval.evaluator",
    "EvalFleet": "align.eval.fleet",
    "pass_at_k": "align.eval.metrics",
    "Scored": "align.eval.metrics",
    "score_eval_set": "align.eval.metrics",
}

__all__ = [
    "CheckpointEvalFn",
    "EvalConfig",
    "EvalDispatcher",
    "EvalFleet",
    "EvalInput",
    "EvalRunner",
    "EvalSet",
    "EvalSkip",
    "Evaluator",
    "Scored",
    "load_eval_fn",
    "make_evaluator",
    "pass_at_k",
    "retarget_args",
    "score_eval_set",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'align.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
