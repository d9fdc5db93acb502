"""Opening a training run: ``open_run(cfg, given, stop_flag) -> Run``, everything ``align.train.train``'s loop calls,
built once from its parts (``align.run.parts``), each opened from the config and the parts before it.

Order (each part uses only what the parts before it made): the task (``RunTask``: the paths and ``--out`` checked,
the data, rewards and tokenizer: bad input fails here, before the model loads; ``config.json`` written, a resumed run
refusing changed math); the ``Learner`` (the policy, its reference and the resumed checkpoint, the optimizer and
schedule, the teacher); the run files (``Logs``); the rollout backend (``--rollout``, a row of
``align.rollout.backends.BACKENDS``: the native sampler, or a spool worker it spawns or attaches to); the
``Evaluation``; the ``Rollouts`` (the sampler's pipeline, which the loop asks for each step's groups); the watchdog.
A failure while opening closes what opened, in reverse; ``Run.close()`` tears the parts down (pipeline, rollout
backend, scorer, sampler, logs, teacher) after draining the evaluator.

Each component owns its cadence: ``Checkpointer.save(step, last_step=, force=)`` decides whether a checkpoint is
due, ``Run.eval_step`` asks the evaluator, ``RolloutPipeline.publish`` the rollout engine. Rank-0-only work under
torchrun sits in the run's sinks (``dist.RankLog`` on the other ranks), never in the loop.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from functools import partial
from typing import Any

from align import dist
from align.run.config import TrainConfig
from align.run.evaluation import Evaluation, rollout_params
from align.run.parts import Logs, Rollouts, Run, RunTask, signalled
from align.run.policy import Learner, stop_ids
from align.run.task import Given

log = logging.getLogger(__name__)


def open_run(cfg: TrainConfig, given: Given | None = None, stop_flag: dict | None = None) -> Run:
    """Build a ``Run`` from its parts (see the module docstring for the order)."""
    from align.device import resolve as resolve_placement
    from align.rollout.backends import BACKENDS
    from align.run.watchdog import Watchdog

    stop_flag = {} if stop_flag is None else stop_flag
    owns_group = dist.setup(cfg)  # torchrun: the process group (no-op in one process)
    place = resolve_placement(cfg.device, cfg.precision)  # bad --device / --precision fail here, before any load
    with ExitStack() as undo:  # on a failure, what opened is closed, in reverse
        task = RunTask.open(cfg, given or Given(), undo)
        learner, start = Learner.open(cfg, place, task.model_path, task.encoded + task.eval_encoded, task.out)
        undo.callback(learner.close)
        stops = stop_ids(task.task.tokenizer, learner.mcfg)
        logs = Logs.open(cfg, task.out, start.step, start.resumed)
        undo.callback(logs.close)
        ray_eval = task.out / "eval_spool" if cfg.uses_ray and cfg.eval.eval_num_gpus > 0 else None  # eval on Ray
        rollout = BACKENDS[cfg.rollout].open(cfg, rollout_target(cfg, task, learner, place, start.step, ray_eval))
        undo.callback(rollout.close)
        params = rollout_params(cfg, stops)
        if warning := rollout.logprob_warning(params):
            log.warning(warning)
        fleet = eval_fleet(cfg, ray_eval, rollout.worker)
        evaluation = Evaluation.open(cfg, task, learner, place, stops, fleet, should_stop=partial(signalled, stop_flag))
        undo.push(evaluation.drain_after)
        rollouts = Rollouts(cfg, task, rollout, start, params, place, learner.mcfg.max_position_embeddings)
        undo.callback(rollouts.close)
        rollouts.stop_on(partial(signalled, stop_flag))  # its waits end on a signal (align.rollout.pipeline)
        evaluation.pin(rollouts.pipe)  # K >= 1: eval on the engine, pinned to one version
        watchdog = Watchdog.for_run(task.out, cfg.stall_after_s, stop_flag, getattr(rollout.client, "spool", None))
        undo.callback(watchdog.close)
        run = Run(
            cfg, stop_flag, place, owns_group, task, learner, start, logs, rollout, evaluation, rollouts, watchdog
        )
        undo.pop_all()
    return run


def rollout_target(cfg: TrainConfig, task: RunTask, learner: Learner, place: Any, step: int, ray_eval: Any) -> Any:
    """What the rollout backend opens on: the policy at the run's step, its model dir, context and dtype; with an
    eval fleet on Ray, its spool and engines."""
    from align.rollout.backends import Target

    return Target(
        learner.policy,
        task.out,
        step,
        task.model_path,
        learner.mcfg.max_position_embeddings,
        place.compute_dtype_name,
        cfg.lora.enabled,
        eval_spool=ray_eval,
        eval_engines=cfg.eval.num_engines if ray_eval else 0,
        eval_gpus_per_engine=cfg.eval.eval_num_gpus_per_engine,
    )


def eval_fleet(cfg: TrainConfig, ray_eval: Any, worker: Any) -> Any:
    """The eval engines on the rollout fleet's Ray router (``--eval-num-gpus`` with a Ray fleet), else None."""
    from align.eval.fleet import EvalFleet

    return EvalFleet.on_ray_router(cfg.eval, ray_eval, worker) if ray_eval else None
