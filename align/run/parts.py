"""The parts of a training run and the ``Run`` built from them by ``open_run`` (``align.run.build``): the task
(``RunTask``: rows, sampler, scorer, the claimed ``--out``), the ``Learner`` (``align.run.policy``), the logs, the
opened rollout backend (``align.rollout.backends``), the ``Evaluation`` (``align.run.evaluation``), the
``Rollouts`` (the sampler's pipeline), the watchdog and the ``Checkpointer``. Each part opens itself from the config
and what it needs; ``align.train.train``'s stages call into them; each owns its cadence and its teardown.
``RunBase`` is what a GRPO run and an SFT run (``align.sft.run``) share: the logs, checkpoints, export, summary.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from align import dist, heartbeat, lora
from align.learner import StepBatch
from align.rollout.groups import trajectories
from align.run import checkpoint as ckpt
from align.run import safety
from align.run.config import TrainConfig
from align.run.log import MetricsLog, Progress, format_line, make_logger, sample_groups
from align.run.plot import write_plot
from align.run.policy import DataCursor, Learner, Start, completion_text
from align.run.task import Given, Task
from align.run.teacher import check_teacher

# ------------------------------------------------------------------------------------------------ the task


@dataclass
class RunTask:
    """What the run trains on, opened before the model loads: ``--out`` claimed (its lock, the run id), the task
    (``align.run.task``) and its model dir, the sampling seam (``align.envs.sampler``), the scorer, the reward that
    decides pass@k, the prompts' ids (training and held-out); ``config.json`` written."""

    task: Task
    name: str  # the eval set's name: the built-in task's, else "eval"
    model_path: str
    out: Path
    run_id: str
    out_lock: Any
    sampler: Any
    scorer: Any
    pass_reward: str | None
    encoded: list[list[int]]
    eval_encoded: list[list[int]]

    @classmethod
    def open(cls, cfg: TrainConfig, given: Given, undo: Any) -> RunTask:
        """Paths checked and ``--out`` locked, the task resolved and checked (bad input fails here), the sampler
        opened (an environment's open hook: a verifier pool), the scorer, ``config.json``; each opened resource's
        teardown pushed on ``undo`` (an ``ExitStack``)."""
        from align.envs.sampler import open_sampler
        from align.eval.metrics import pass_reward_for
        from align.hub import resolve_model, resolve_tokenizer
        from align.rewards import make_scorer
        from align.run.log import check_logger
        from align.run.sources import apply_backend_defaults
        from align.run.task import resolve_task

        out = Path(cfg.out)
        apply_backend_defaults(cfg)  # the Python API's config: the backend's defaults where nothing was said
        cfg.model, given = resolve_model(cfg.model), replace(given, model=resolve_model(given.model, "model="))
        cfg.data.tokenizer = resolve_tokenizer(cfg.data.tokenizer)
        cfg.distill.teacher = resolve_model(cfg.distill.teacher, "--teacher")
        run_id, out_lock = safety.open_out(cfg, given.model or cfg.model)  # paths checked, --out locked, run id
        undo.callback(safety.release, out_lock)
        check_logger(cfg.log.logger, out)  # the --logger package imports, {out}/tensorboard is a dir
        task, model_path = resolve_task(cfg, given)
        name = cfg.task if given.prompts is None and not cfg.data.train_data else "eval"
        sampler = open_sampler(cfg, task)  # an environment's open hook (a verifier pool) runs here, before the model
        undo.callback(sampler.close)
        rows = task.prompts + task.eval_prompts
        has_reward = task.reward is not None or cfg.rewards.reward
        needs_scorer = has_reward or not (sampler.terms or cfg.distill.distill_only)  # an environment rewards itself
        scorer = sampler.scorer = make_scorer(cfg.rewards, task.reward, rows) if needs_scorer else None
        if scorer is not None:  # --group-timeout-s: each group scored in its own thread (align.rollout.deadlines)
            undo.callback(scorer.close)
            scorer.concurrent = cfg.group_timeout_s > 0
        check_teacher(cfg, model_path, task.tokenizer, task.prompts)  # --teacher: an HF dir, the same tokenizer
        pass_reward = None  # the reward that decides pass@k (--eval-pass-reward); refused before the model loads
        names = [*sampler.terms, *(scorer.names if scorer else [])]
        if task.eval_prompts and cfg.eval.eval_interval > 0:  # episodes: the environment's verdict decides by default
            pass_reward = pass_reward_for(names, cfg.eval.eval_pass_reward or next(iter(sampler.terms), None))
        write_config(cfg, out, model_path)
        encoded, eval_encoded = sampler.encode()  # an episode's first prompt is its reset(): no ids here
        return cls(task, name, model_path, out, run_id, out_lock, sampler, scorer, pass_reward, encoded, eval_encoded)


def write_config(cfg: Any, out: Path, model_path: str) -> None:
    """``{out}/config.json`` (and ``config_sources.json``: each value's layer, ``align.run.sources``); resuming, a
    changed setting that changes the math is refused, others are applied."""
    from align.run.sources import keep_resumed

    resuming = ckpt.latest(out / "checkpoints")
    if resuming:  # a default that depends on the backend keeps the resumed run's value (one made before it existed)
        for kept in keep_resumed(cfg, safety.read_saved_config(out / "config.json")):
            print(f"[align] resume: keeping the resumed run's setting {kept}", flush=True)
    new_config = json.loads(json.dumps({**asdict(cfg), "model": model_path}))  # as saved: tuples are lists
    if resuming:  # resuming: refuse changed math, apply (and log) operational changes
        for change in safety.check_resume_config(out / "config.json", new_config):
            print(f"[align] resume: applying changed setting {change}", flush=True)
    if dist.is_main():
        from align.atomic import atomic_write_text
        from align.run.sources import SOURCES_FILE, sources_of

        atomic_write_text(out / "config.json", json.dumps(new_config, indent=2), shared=True)
        atomic_write_text(
            out / SOURCES_FILE, json.dumps(sources_of(cfg), indent=2), shared=True
        )  # where each value came from


# ------------------------------------------------------------------------------------------------ the logs


class Logs:
    """metrics.jsonl, completions.jsonl (the sampled groups), the logger sink (torchrun: rank 0 alone writes)."""

    def __init__(self, metrics: Any, samples: Any) -> None:
        self.metrics, self.samples = metrics, samples

    @classmethod
    def open(cls, cfg: Any, out: Path, step: int, resumed: bool) -> Logs:
        if not dist.is_main():
            return cls(dist.RankLog(), dist.RankLog())
        resume_step = step if resumed else 0
        logs = cls(MetricsLog(out / "metrics.jsonl", resume_step), MetricsLog(out / "completions.jsonl", resume_step))
        if (sink := make_logger(cfg.log.logger, out, asdict(cfg), step)) is not None:
            logs.metrics.sinks.append(sink)
        return logs

    def close(self) -> None:
        self.metrics.close()


# ------------------------------------------------------------------------------------------------ the rollouts


class Rollouts:
    """The sampling side of a step: the sampler started on the run's sampling params and data cursor, and the
    rollout pipeline (``align.rollout.pipeline``) around its ``collect``, on the opened rollout backend."""

    def __init__(self, cfg: Any, task: RunTask, backend: Any, start: Start, params: Any, place: Any, context: int):
        from align.rollout.pipeline import make_pipeline

        self.sampler = task.sampler
        self.cursor = DataCursor(len(task.task.prompts), cfg.seed, start.cursor)
        self.sampler.start(
            params=params,
            cursor=self.cursor,
            encoded=task.encoded,
            decode=partial(completion_text, task.task.tokenizer, params.stop_token_ids),
            context=context,
            autocast=place.autocast,
        )
        snapshots = task.out / "rollout_snapshots"
        carry = None
        if cfg.partial_rollouts:  # the carried groups: the sampler draws from them, the pipeline checkpoints them
            from align.rollout.partial import Carry

            carry = self.sampler.carry = Carry(
                cfg.group_size,
                cfg.max_token_staleness,
                cfg.stale_policy,
                start.carried,
                cfg.partial_pool_factor,
                cfg.partial_prefill,
            )
        self.pipe = make_pipeline(
            cfg, self.collect, backend, start.step, self.cursor.state, start.pending, snapshots, carry
        )

    def stop_on(self, should_stop: Any) -> None:
        """The pipeline's waits end when ``should_stop()`` (a signal: ``Run.signalled``)."""
        self.pipe.should_stop = should_stop

    def collect(self, t: int, version: int, gen: Any) -> Any:
        """1-3 of step t: prompts -> rollouts (from weights ``version`` on client ``gen``) -> rewards."""
        # a signal cuts the rewards at K = 0 in one process (a reward stuck in a sleep would hold the exit); K >= 1
        # abandons the producer instead (pipeline), and under torchrun every rank finishes the step (agree_on_signal)
        return self.sampler.collect(t, gen, None if self.pipe.is_async or dist.active() else self.pipe.should_stop)

    def close(self) -> None:
        self.pipe.close()


# ------------------------------------------------------------------------------------------------ checkpoints


class Checkpointer:
    """Writes ``{out}/checkpoints/step_N`` when due: every ``--checkpoint-every`` steps, at the last step, or when
    forced (a signal). torchrun: each rank writes its DCP shards, rank 0 commits (``align.run.checkpoint``)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def save(self, step: int, *, last_step: bool = False, force: bool = False) -> bool:
        r, every = self.run, self.run.cfg.checkpoint_every
        due = last_step or (every and step % every == 0)
        if not (due or force) or (not due and (r.out / "checkpoints" / f"step_{step}").is_dir()):
            return False  # forced but committed already: a signal while the next step waited for its rollouts
        extra = {"scheduler": r.sched.state_dict(), "nonfinite_steps": r.nonfinite.count, **r.checkpoint_state(step)}
        with heartbeat.working("checkpointer", step=step):
            ckpt.save_any(r.out / "checkpoints", step, r.policy, r.opt, extra, r.cfg.keep_checkpoints)
        r.write_plot()
        return True


# ------------------------------------------------------------------------------------------------ the run


def signalled(stop_flag: dict) -> bool:
    """A signal arrived (``main``'s handlers): the evaluator and the pipeline's waits end on it."""
    return bool(stop_flag.get("signal") or stop_flag.get("stall"))  # or the watchdog (a stall)


class RunBase:
    """What every run holds between its opening and ``close``, GRPO's (``Run``) and SFT's (``align.sft.run``): the
    config, the stop flag, the step, the logs and progress line, checkpoints, the final export and the summary."""

    cfg: Any
    out: Path
    plot_title = "align GRPO"
    run_id: str
    out_lock: Any = None
    owns_group: bool
    model_path: str
    resumed: bool
    evaluator: Any = None
    logs: Any = None
    metrics: Any = None
    watchdog: Any = None  # --stall-timeout-s (align.run.watchdog)

    def __init__(self, cfg: Any, stop_flag: dict) -> None:
        self.cfg, self.stop_flag, self.out = cfg, stop_flag, Path(cfg.out)
        self.t_start = time.monotonic()
        self.progress: Any = dist.RankLog()
        self.first_error: list[str] = []
        self.checkpointer = Checkpointer(self)
        self.step = 0
        self.carried: list = []  # --partial-rollouts: the resumed checkpoint's carried groups

    def use_logs(self, logs: Logs) -> None:
        """The run's logs: metrics.jsonl (its ``records``), completions.jsonl."""
        self.logs, self.metrics, self.samples, self.records = logs, logs.metrics, logs.samples, logs.metrics.records

    def emit(self, records: list[dict]) -> None:
        for r in records:
            self.metrics.write(r)
            if dist.is_main():
                print(format_line(r), flush=True)

    def signalled(self) -> bool:
        return signalled(self.stop_flag)

    def write_plot(self) -> None:
        if dist.is_main():
            write_plot(self.out / "plot.svg", self.records, title=f"{self.plot_title}: {self.out.name}")

    # ---------------------------------------------------------------------- teardown

    def __enter__(self) -> RunBase:  # noqa: PYI034
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(after_error=exc)

    def parts(self) -> list[Any]:
        """What ``close`` closes after draining the evaluator, in order (each has ``close()``; None: not opened)."""
        return [getattr(self, "scorer", None), self.logs]

    def close(self, after_error: BaseException | None = None) -> None:
        """Drain the evaluator, then close the parts (each once)."""
        self.progress.close()
        if self.watchdog is not None:
            self.watchdog.close()
            from align.rollout.client import WorkerDiedError

            if isinstance(after_error, WorkerDiedError):  # a rollout worker stopped: the watchdog's stall.txt and line
                self.watchdog.worker_stopped(after_error)
        try:
            if self.evaluator is not None:
                self.emit(self.evaluator.drain(after_error=after_error))
        finally:
            parts, self.closed = ([] if getattr(self, "closed", False) else self.parts()), True
            for part in parts:
                if part is not None:
                    part.close()  # the rollout backend: its client, worker and spool lock
            if after_error is not None:  # the run ends here; else summary() releases --out after export_final
                safety.release(self.out_lock)

    def export_final(self) -> None:
        """--save-hf after the last step (torchrun: streamed to rank 0's CPU, written by it), then plot.svg."""
        cfg = self.cfg
        if cfg.save_hf and self.step == cfg.steps:
            full = dist.full_model(self.policy, to_main_cpu=True)
            if dist.is_main():
                tok_src = cfg.data.tokenizer or self.model_path
                safety.export_hf(
                    lambda d: lora.save_policy(full, d, merge=cfg.merge_lora, copy_tokenizer_from=tok_src),
                    cfg.save_hf,
                    self.run_id,
                    cfg.overwrite,
                    self.step,
                )
        self.write_plot()

    def summary(self) -> dict:
        evals = [r for r in self.records if "eval/pass@1" in r]
        out = {
            "steps": self.step,
            "eval_start": evals[0]["eval/pass@1"] if evals else None,
            "eval_end": evals[-1]["eval/pass@1"] if evals else None,
            "wall_s": time.monotonic() - self.t_start,
            "out": str(self.out),
            "interrupted": self.stop_flag.get("signal"),
            "stalled": self.stop_flag.get("stall"),  # the watchdog's line, when it stopped the run at a safe point
        }
        dist.teardown(self.owns_group)  # torchrun: the group train() created ends with it
        safety.release(self.out_lock)  # the run's life ends: --out may be used by another run
        return out


class Run(RunBase):
    """A GRPO run built from its parts (``open_run``); the loop's stages call into it."""

    cfg: TrainConfig

    def __init__(
        self,
        cfg: TrainConfig,
        stop_flag: dict,
        place: Any,
        owns_group: bool,
        task: RunTask,
        learner: Learner,
        start: Start,
        logs: Logs,
        rollout: Any,
        evaluation: Any,
        rollouts: Rollouts,
        watchdog: Any,
    ) -> None:
        super().__init__(cfg, stop_flag)
        self.place, self.owns_group, self.run_task, self.learner = place, owns_group, task, learner
        self.use_logs(logs)
        self.rollout, self.evaluation, self.rollouts, self.watchdog = rollout, evaluation, rollouts, watchdog
        self.client, self.worker, self.evaluator = rollout.client, rollout.worker, evaluation.evaluator
        self.policy, self.opt, self.sched, self.nonfinite = (
            learner.policy,
            learner.opt,
            learner.sched,
            learner.nonfinite,
        )
        self.task, self.sampler, self.scorer, self.pipe = task.task, task.sampler, task.scorer, rollouts.pipe
        self.model_path, self.run_id, self.out_lock = task.model_path, task.run_id, task.out_lock
        self.step, self.resumed, self.cursor = start.step, start.resumed, rollouts.cursor
        if dist.is_main():
            self.progress = Progress(cfg.steps, start=self.step)

    # ---------------------------------------------------------------------- per-step helpers

    def scores(self, groups: Any) -> Any:
        """The step's (P, G) total, terms, lengths and truncation (NaN = unscorable); the rewards checked."""
        scores = groups.tensors(self.cfg.group_size)
        groups.check_reward_failures(self.step + 1, self.first_error)
        return scores

    def batch(self, groups: Any, adv: torch.Tensor, valid: torch.Tensor) -> StepBatch:
        return StepBatch(self.sampler.prompt_ids(groups.idx), trajectories(groups.completions), adv, valid)

    def checkpoint_state(self, step: int) -> dict:
        """What a checkpoint after ``step`` keeps besides the weights, optimizer and schedule: the data cursor and
        (K >= 1) the rollout pipeline's pending batches."""
        return self.pipe.checkpoint_state(step, self.cursor.state)

    def log(self, rec: dict, groups: Any, scores: Any, adv: torch.Tensor, upd: Any) -> None:
        """The step's record to metrics.jsonl and the progress line; sample groups every --log-completions-every;
        then the non-finite count, which stops the run at --max-nonfinite-steps (before any checkpoint)."""
        rec.update(self.sampler.metrics(groups.completions))  # an environment's own metrics (its metrics hook)
        self.metrics.write(rec)
        self.progress.update(rec["step"], format_line(rec))
        every = self.cfg.log.log_completions_every
        if every and rec["step"] % every == 0:
            rows = self.task.prompts  # an index past the rows is a drawn row of an environment's own (episodes show it)
            prompts = [rows[i].get("prompt", "") if i < len(rows) else "" for i in groups.idx]
            for r in sample_groups(
                rec["step"],
                prompts,
                groups.completions,
                groups.texts,
                scores.total,
                adv,
                scores.terms,
                self.cfg.log.log_completions_groups,
                self.task.tokenizer.decode if self.cfg.log.log_token_ids else None,
            ):
                self.samples.write(r)
        for e in groups.evicted:  # --group-timeout-s: each evicted group and why, in the completions log
            self.samples.write({"step": rec["step"], "evicted_group": e})
        self.nonfinite.add(upd, rec["step"])

    def eval_step(self, step: int, is_final: bool) -> list[dict]:
        return self.evaluation.step(step, is_final)

    def baseline(self) -> list[dict]:
        """The step-0 eval, once per run, through the evaluator's own path."""
        return self.evaluation.baseline(self.metrics.records, self.resumed)

    def parts(self) -> list[Any]:
        return [self.rollouts, self.rollout, self.scorer, self.sampler, self.logs, self.learner]
