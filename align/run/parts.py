"""The parts of a training run and the ``Run`` that holds them between ``open_run`` (``align.run.build``) and
``close``: the ``Learner`` (policy, reference, optimizer, schedule, teacher: ``update(batch)``), the opened rollout
backend (``align.rollout.backends``), the ``Checkpointer``, the evaluator, the logs. ``align.train.train``'s stages
call into them; each part owns its cadence and its teardown.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from align import dist, heartbeat, lora
from align.learner import StepBatch, Update, make_batch, optimize
from align.rollout.groups import trajectories
from align.run import checkpoint as ckpt
from align.run import safety
from align.run.config import TrainConfig
from align.run.log import format_line, sample_groups
from align.run.plot import write_plot


class Learner:
    """The trainable side of a run: the policy, its frozen reference (or None), the optimizer and its schedule, the
    teacher (on-policy distillation, or None). ``update(batch)`` is one step's learning."""

    def __init__(self, policy: Any, ref_model: Any, opt: Any, sched: Any, cfg: Any, place: Any, teacher: Any) -> None:
        self.policy, self.ref_model, self.opt, self.sched = policy, ref_model, opt, sched
        self.cfg, self.place, self.teacher = cfg, place, teacher

    def update(self, batch: StepBatch) -> Update:
        """The step's batch on ``place.device``, ``align.learner.optimize`` (micro-batches, global normalisers), then
        the schedule's step."""
        on_device = make_batch(batch, self.cfg, self.place.device)
        with heartbeat.working("learner"):
            upd = optimize(self.policy, self.ref_model, self.opt, self.cfg, self.place, on_device, self.teacher)
        self.sched.step()
        return upd


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


class Run:
    """Everything a training run holds between ``open_run`` and ``close``; the loop's stages call into it."""

    cfg: TrainConfig
    out: Path
    plot_title = "align GRPO"

    def __init__(self, cfg: TrainConfig, stop_flag: dict) -> None:
        self.cfg, self.stop_flag, self.out = cfg, stop_flag, Path(cfg.out)
        self.t_start = time.monotonic()
        self.rollout: Any = None  # the opened rollout backend (align.rollout.backends): client, worker, spool lock
        self.learner: Any = None
        self.scorer = self.pipe = self.out_lock = self.sampler = None
        self.teacher: Any = None  # on-policy distillation (align.run.teacher)
        self.metrics: Any = None
        self.samples: Any = None
        self.progress: Any = dist.RankLog()
        self.first_error: list[str] = []
        self.eval_weights: list = []  # torchrun: the eval step's weights, gathered to rank 0's CPU by every rank
        self.checkpointer = Checkpointer(self)
        self.watchdog: Any = None  # --stall-timeout-s (align.run.watchdog)
        self.step = 0

    # ---------------------------------------------------------------------- per-step helpers

    @property
    def client(self) -> Any:
        return None if self.rollout is None else self.rollout.client

    @property
    def worker(self) -> Any:
        return None if self.rollout is None else self.rollout.worker

    def scores(self, groups: Any) -> Any:
        """The step's (P, G) total, terms, lengths and truncation (NaN = unscorable); the rewards checked."""
        scores = groups.tensors(self.cfg.group_size)
        groups.check_reward_failures(self.step + 1, self.first_error)
        return scores

    def batch(self, groups: Any, adv: torch.Tensor, valid: torch.Tensor) -> StepBatch:
        return StepBatch(self.prompt_ids(groups), trajectories(groups.completions), adv, valid)

    def prompt_ids(self, groups: Any) -> list[list[int]]:
        return self.sampler.prompt_ids(groups.idx)

    def completion_text(self, ids: list[int]) -> str:
        return self.task.tokenizer.decode(ids[:-1] if ids and ids[-1] in self.stops else ids)

    def checkpoint_state(self, step: int) -> dict:
        """What a checkpoint after ``step`` keeps besides the weights, optimizer and schedule: the data cursor and
        (K >= 1) the rollout pipeline's pending batches."""
        return self.pipe.checkpoint_state(step, self.cursor.state)

    def emit(self, records: list[dict]) -> None:
        for r in records:
            self.metrics.write(r)
            if dist.is_main():
                print(format_line(r), flush=True)

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
        """Due evals of ``step`` (the evaluator decides) and finished ones; torchrun gathers a snapshot's weights."""
        if dist.active() and self.eval_cfg.uses_snapshots and self.eval_cfg.is_due(step, is_final):
            self.eval_weights[:] = [dist.full_model(self.policy, to_main_cpu=True)]  # a collective: all ranks
        return self.evaluator.step(step, is_final) + self.evaluator.poll()

    def signalled(self) -> bool:
        """A signal arrived (``main``'s handlers): the evaluator and the pipeline's waits end on it."""
        return bool(self.stop_flag.get("signal") or self.stop_flag.get("stall"))  # or the watchdog (a stall)

    def score_eval(self, i: int, ids: list[int]) -> Any:
        """Held-out prompt ``i``'s completion ``ids`` scored, with the reward that decides pass@k."""
        from align.eval.metrics import scored

        text = self.completion_text(ids)
        return scored(*self.scorer.score([(self.task.eval_prompts[i], text)]).item(0), self.pass_reward)

    def export_eval(self, path: str) -> None:
        """An eval point's snapshot. LoRA: the adapter (the fleet serves it on the base model); merged for a
        CheckpointEvalFn's own backend. torchrun: the weights rank 0 gathered (``eval_step``)."""
        lora.save_policy(
            self.eval_weights.pop() if dist.active() else self.policy,
            path,
            merge=self.cfg.eval.eval_function_path is not None,
            copy_tokenizer_from=self.cfg.data.tokenizer or self.model_path,
        )

    def write_plot(self) -> None:
        if dist.is_main():
            write_plot(self.out / "plot.svg", self.records, title=f"{self.plot_title}: {self.out.name}")

    def baseline_dir(self) -> str:
        """The step-0 snapshot: the base model; in LoRA mode with an eval fleet the untrained adapter (written once,
        atomically, before step 1), so the fleet starts its engines with LoRA enabled for every later point."""
        cfg = self.cfg
        if not (cfg.lora.enabled and cfg.eval.eval_num_gpus > 0 and not cfg.eval.eval_function_path):
            return self.model_path
        step0 = self.out / "lora_step0_adapter"
        if not self.resumed and not (step0 / "adapter_config.json").exists():
            lora.save_policy(self.policy, step0)
        return str(step0) if (step0 / "adapter_config.json").exists() else self.model_path

    def baseline(self) -> list[dict]:
        """The step-0 eval, once per run, through the evaluator's own path."""
        if self.eval_set is None:
            return []
        return self.evaluator.baseline(self.baseline_dir(), written=self.metrics.records, resumed=self.resumed)

    # ---------------------------------------------------------------------- teardown

    def __enter__(self) -> Run:  # noqa: PYI034
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(after_error=exc)

    def close(self, after_error: BaseException | None = None) -> None:
        """Drain the evaluator, then stop the pipeline, client, scorer, logs and worker (each once)."""
        self.progress.close()
        if self.watchdog is not None:
            self.watchdog.close()
        try:
            if getattr(self, "evaluator", None) is not None:
                self.emit(self.evaluator.drain(after_error=after_error))
        finally:
            for part in (self.pipe, self.rollout, self.scorer, self.sampler, self.metrics, self.teacher):
                if part is not None:
                    part.close()  # the rollout backend: its client, worker and spool lock
            self.pipe = self.rollout = self.scorer = self.metrics = self.sampler = self.teacher = None
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
