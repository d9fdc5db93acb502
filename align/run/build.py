"""Opening a training run: ``open_run(cfg, ...) -> Run``, everything ``align.train.train``'s loop calls, built once.

Order (each step uses only what the steps before it made): validate the paths and the task (data, rewards,
tokenizer: bad input fails here, before the model loads); write ``config.json`` (a resumed run refuses changed
math); the policy, its reference and the resumed checkpoint; the optimizer and schedule; the run files; the rollout
client (native sampler, or a spool worker it spawns or attaches to); the evaluator; the rollout pipeline that the
loop asks for each step's groups. ``Run.close()`` tears it down in reverse (pipeline, client, scorer, logs, worker),
after draining the evaluator.

Each component owns its cadence: ``Checkpointer.save(step, last_step=, force=)`` decides whether a checkpoint is
due, ``Run.eval_step`` asks the evaluator, ``RolloutPipeline.publish`` the rollout engine. Rank-0-only work under
torchrun sits in the run's sinks (``dist.RankLog`` on the other ranks), never in the loop.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from align import dist, learner, lora
from align import model as model_lib
from align.run import checkpoint as ckpt
from align.run import safety
from align.run.config import TrainConfig, lr_lambda
from align.run.log import MetricsLog, Progress, check_logger, format_line, make_logger, sample_groups
from align.run.plot import write_plot
from align.run.task import resolve_task
from align.run.teacher import check_teacher, open_teacher, unscored

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ the task


def stop_ids(tokenizer: Any, model_cfg: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = model_cfg.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def batch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
    return order


class DataCursor:
    """Which prompts come next: epochs of a seeded shuffle. ``state`` ({"epoch", "index"}) is what a checkpoint
    stores; the rollout pipeline reads it (under its lock) on the producer thread with K >= 1."""

    def __init__(self, n: int, seed: int, state: dict | None = None) -> None:
        self.n, self.seed = n, seed
        self.state = dict(state) if state else {"epoch": 0, "index": 0}

    def next_prompts(self, k: int) -> list[int]:
        order = batch_order(self.n, self.seed, self.state["epoch"])
        idx = []
        while len(idx) < k:
            if self.state["index"] >= len(order):
                self.state["epoch"] += 1
                self.state["index"] = 0
                order = batch_order(self.n, self.seed, self.state["epoch"])
            idx.append(order[self.state["index"]])
            self.state["index"] += 1
        return idx


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
        self.worker = self.client = self.scorer = self.pipe = self.out_lock = self.spool_lock = self.envs = None
        self.teacher: Any = None  # on-policy distillation (align.run.teacher)
        self.metrics: Any = None
        self.samples: Any = None
        self.progress: Any = dist.RankLog()
        self.first_error: list[str] = []
        self.eval_weights: list = []  # torchrun: the eval step's weights, gathered to rank 0's CPU by every rank
        self.checkpointer = Checkpointer(self)
        self.step = 0

    # ---------------------------------------------------------------------- per-step helpers

    def prompt_ids(self, groups: Any) -> list[list[int]]:
        if self.task.env is not None:  # an episode carries its own first prompt (a --env lean correction has no row)
            return [[] for _ in groups.idx]
        return [self.encoded[i] for i in groups.idx]

    def completion_text(self, ids: list[int]) -> str:
        return self.task.tokenizer.decode(ids[:-1] if ids and ids[-1] in self.stops else ids)

    def checkpoint_state(self, step: int) -> dict:
        """What a checkpoint after ``step`` keeps besides the weights, optimizer and schedule: the data cursor and
        (K >= 1) the rollout pipeline's pending batches."""
        return self.pipe.checkpoint_state(step, self.cursor.state)

    def check_rewards(self, groups: Any, step: int) -> None:
        groups.check_scores(step, self.first_error)

    def emit(self, records: list[dict]) -> None:
        for r in records:
            self.metrics.write(r)
            if dist.is_main():
                print(format_line(r), flush=True)

    def log(self, rec: dict, groups: Any, scores: Any, adv: torch.Tensor) -> None:
        """The step's record to metrics.jsonl and the progress line; sample groups every --log-completions-every."""
        if self.envs is not None:  # the environment's own metrics (--env lean: lean/*)
            rec.update(self.envs.metrics(groups.completions))
        self.metrics.write(rec)
        self.progress.update(rec["step"], format_line(rec))
        every = self.cfg.log.log_completions_every
        if every and rec["step"] % every == 0:
            rows = self.task.prompts  # an index past the rows is a --env lean correction prompt (its episodes show it)
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
            ):
                self.samples.write(r)

    def eval_step(self, step: int, is_final: bool) -> list[dict]:
        """Due evals of ``step`` (the evaluator decides) and finished ones; torchrun gathers a snapshot's weights."""
        if dist.active() and self.eval_cfg.uses_snapshots and self.eval_cfg.is_due(step, is_final):
            self.eval_weights[:] = [dist.full_model(self.policy, to_main_cpu=True)]  # a collective: all ranks
        return self.evaluator.step(step, is_final) + self.evaluator.poll()

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
        try:
            if getattr(self, "evaluator", None) is not None:
                self.emit(self.evaluator.drain(after_error=after_error))
        finally:
            for part in (self.pipe, self.client, self.scorer, self.envs, self.metrics, self.teacher):
                if part is not None:
                    part.close()
            if self.worker is not None:
                self.worker.shutdown()
            self.pipe = self.client = self.scorer = self.metrics = self.worker = self.envs = self.teacher = None
            safety.release(self.spool_lock)  # the worker is gone: another trainer may take the spool
            self.spool_lock = None
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
        }
        dist.teardown(self.owns_group)  # torchrun: the group train() created ends with it
        safety.release(self.out_lock)  # the run's life ends: --out may be used by another run
        return out


# ------------------------------------------------------------------------------------------------ open_run


def open_run(
    cfg: TrainConfig,
    *,
    model: str | None = None,
    tokenizer: Any = None,
    prompts: list | None = None,
    reward: Callable[..., float | None] | None = None,
    eval_prompts: list | None = None,
    env: Any = None,
    tools: list | None = None,
    stop_flag: dict | None = None,
) -> Run:
    """Build a ``Run`` (see the module docstring for the order). On a failure after parts started, they are closed."""
    from align.device import resolve as resolve_placement

    run = Run(cfg, {} if stop_flag is None else stop_flag)
    run.owns_group = dist.setup(cfg)  # torchrun: the process group (no-op in one process)
    run.place = resolve_placement(cfg.device, cfg.precision)  # bad --device / --precision fail here, before any load
    try:
        _open_files_and_task(run, model, tokenizer, prompts, reward, eval_prompts, env, tools)
        _open_policy(run)
        _open_logs(run)
        _open_rollout(run)
        _open_eval(run)
        _open_pipeline(run)
    except BaseException as e:
        run.close(after_error=e)
        raise
    return run


def _open_files_and_task(
    run: Run, model: Any, tokenizer: Any, prompts: Any, reward: Any, eval_prompts: Any, env: Any, tools: Any
) -> None:
    from align.eval.metrics import pass_reward_for
    from align.rewards import make_scorer

    cfg, out = run.cfg, run.out
    run.run_id, run.out_lock = safety.open_out(cfg, model or cfg.model)  # paths checked, --out locked, run id
    check_logger(cfg.log.logger, out)  # the --logger package imports, {out}/tensorboard is a dir
    run.task, run.model_path = resolve_task(cfg, model, tokenizer, prompts, reward, eval_prompts, env, tools)
    run.task_name = cfg.task if prompts is None and not cfg.data.train_data else "eval"
    task = run.task
    rows = task.prompts + task.eval_prompts
    has_reward = task.reward is not None or cfg.rewards.reward
    needs_scorer = (task.env is None or has_reward) and (has_reward or not cfg.distill.distill_only)
    run.scorer = make_scorer(cfg.rewards, task.reward, rows) if needs_scorer else None
    check_teacher(cfg, run.model_path, task.tokenizer, task.prompts)  # --teacher: an HF dir, the same tokenizer
    run.pass_reward = None  # the reward that decides pass@k (--eval-pass-reward); refused before the model loads
    names = ["env"] * (task.env is not None) + (run.scorer.names if run.scorer else [])
    if task.eval_prompts and cfg.eval.eval_interval > 0:
        choice = cfg.eval.eval_pass_reward or ("env" if task.env is not None else None)  # episodes: the env's verdict
        run.pass_reward = pass_reward_for(names, choice)
    if task.env is not None:
        from align.run.episodes import open_episodes

        open_episodes(run)  # the environment runner and the turn renderer; refuses what it cannot run
    write_config(cfg, out, run.model_path)


def write_config(cfg: Any, out: Path, model_path: str) -> None:
    """``{out}/config.json``; resuming, a changed setting that changes the math is refused, others are applied."""
    new_config = json.loads(json.dumps({**asdict(cfg), "model": model_path}))  # as saved: tuples are lists
    if ckpt.latest(out / "checkpoints"):  # resuming: refuse changed math, apply (and log) operational changes
        for change in safety.check_resume_config(out / "config.json", new_config):
            print(f"[align] resume: applying changed setting {change}", flush=True)
    if dist.is_main():
        from align.atomic import atomic_write_text

        atomic_write_text(out / "config.json", json.dumps(new_config, indent=2))


def _open_policy(run: Run) -> None:
    """Policy (resumed, LoRA, sharded), reference, optimizer, schedule; the prompts encoded and checked."""
    cfg, place, out = run.cfg, run.place, run.out
    tok = run.task.tokenizer
    if run.task.env is not None:  # an episode's first prompt is its environment's reset(): no prompt ids here
        run.encoded, run.eval_encoded = [[] for _ in run.task.prompts], []
    else:
        run.encoded, run.eval_encoded = run.task.encoded or (
            [tok.encode(r["prompt"]) for r in p] for p in (run.task.prompts, run.task.eval_prompts)
        )
    learner.check_token_budget(cfg, [len(ids) for ids in run.encoded])  # before the model loads
    cfg.moe.check_run(cfg.rollout, run.model_path)  # --routing-replay: a MoE model and the native rollout
    load = model_lib.load_pretrained  # looked up at call time (tests patch align.model.load_pretrained)
    policy, resume, state = load_policy(cfg, place, run.model_path, out)
    mcfg = policy.config
    ref_model = None
    if cfg.loss.kl_coef > 0 and cfg.lora.enabled:  # the policy with its adapters off is the frozen base: no 2nd copy
        ref_model = policy  # (align.learner.reference_logprobs runs it inside align.lora.adapters_disabled)
    elif cfg.loss.kl_coef > 0:
        ref_model = load(run.model_path, dtype=place.frozen_dtype, device=place.device).requires_grad_(False)
    run.stops = stop_ids(run.task.tokenizer, mcfg)
    for i, ids in enumerate(run.encoded + run.eval_encoded):
        if len(ids) + cfg.max_tokens > mcfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} ({len(ids)} tokens) + --max-tokens {cfg.max_tokens} does not fit the model's context "
                f"of {mcfg.max_position_embeddings}; shorten it or lower --max-tokens"
            )
    policy, ref_model = dist.shard(policy, place.precision), ref_model and dist.shard(ref_model, place.precision)
    run.opt, run.sched = open_optimizer(cfg, policy, place, resume, state)
    cursor, run.pending = None, []
    if resume:
        run.step, cursor, run.pending = state["step"], state["cursor"], state.get("pending_batches", [])
        print(f"[align] resuming from {resume[1]} (step {run.step})", flush=True)
    run.cursor = DataCursor(len(run.task.prompts), cfg.seed, cursor)
    run.nonfinite = learner.NonFiniteSteps(cfg.max_nonfinite_steps, (state or {}).get("nonfinite_steps", 0))
    run.policy, run.ref_model, run.mcfg, run.resumed = policy, ref_model, mcfg, bool(resume)
    run.teacher = open_teacher(run)  # --teacher: frozen like the reference, or a vLLM worker
    if not resume:
        torch.manual_seed(cfg.seed)


def load_policy(cfg: Any, place: Any, model_path: str, out: Path) -> tuple[torch.nn.Module, tuple | None, dict | None]:
    """(policy, the checkpoint to resume or None, its trainer state or None): the model of ``model_path`` (LoRA:
    frozen base + trainable adapters; a LoRA checkpoint holds only the adapter), or a resumed single-process
    checkpoint's; a sharded (torchrun) checkpoint is loaded into it after sharding (``open_optimizer``). Sets
    gradient checkpointing and the CPU threads."""
    from align.device import resolve_threads

    load = model_lib.load_pretrained  # looked up at call time (tests patch align.model.load_pretrained)
    resume = dist.main_first(lambda: ckpt.pick(out / "checkpoints", cfg.resume_from))  # rank 0 moves later ones aside
    if cfg.lora.enabled:
        policy = load(model_path, dtype=place.param_dtype, device=place.device)
        lora.apply_lora(policy, cfg.lora, base_model=model_path, seed=cfg.seed)
        if resume:
            ckpt.load_adapter(policy, resume[1])
    elif resume and not ckpt.is_sharded(resume[1]):
        policy = ckpt.load_model(resume[1], place.param_dtype, device=place.device)
    else:
        policy = load(model_path, dtype=place.param_dtype, device=place.device)
    state = ckpt.load_state(resume[1]) if resume else None
    if resume and ckpt.is_sharded(resume[1]):  # on every rank, before any collective
        ckpt.check_model_config(resume[1], state, policy)
    policy.gradient_checkpointing = cfg.gradient_checkpointing
    cfg.moe.prepare(policy)  # MoE: --freeze-router
    torch.set_num_threads(resolve_threads(cfg.threads))  # --threads 0: OMP_NUM_THREADS, else every CPU
    return policy, resume, state


def open_optimizer(
    cfg: Any, policy: torch.nn.Module, place: Any, resume: tuple | None, state: dict | None
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW on the trainable parameters and the LR schedule (``lr_lambda``) of the (sharded) policy; resuming, their
    states (and a sharded checkpoint's weights) restored: any world size resumes any checkpoint (DCP resharding, or
    the full single-process state)."""
    from align.device import make_optimizer

    opt = make_optimizer(
        lora.trainable_parameters(policy), place, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    if resume:
        ckpt.restore_any(resume[1], state, policy, opt)
        sched.load_state_dict(state["scheduler"])
    return opt, sched


def _open_logs(run: Run) -> None:
    """metrics.jsonl, completions.jsonl, the logger sink and the progress line (torchrun: rank 0 alone writes)."""
    cfg, out, step = run.cfg, run.out, run.step
    if dist.is_main():
        run.metrics = MetricsLog(out / "metrics.jsonl", resume_step=step if run.resumed else 0)
        run.samples = MetricsLog(out / "completions.jsonl", resume_step=step if run.resumed else 0)
        if (sink := make_logger(cfg.log.logger, out, asdict(cfg), step)) is not None:
            run.metrics.sinks.append(sink)
    else:
        run.metrics, run.samples = dist.RankLog(), dist.RankLog()
    run.records = run.metrics.records


def _open_rollout(run: Run) -> None:
    """The rollout client: the native sampler on the policy, or a spool worker (spawned, or attached to) serving the
    run's initial snapshot ``rollout_snapshots/v{step}``; the sampling params and the logprob-basis warning."""
    from align.rollout import client as client_mod
    from align.rollout.engines import save_snapshot
    from align.rollout.protocol import SamplingParams, logprob_basis_warning

    cfg, out, step, policy = run.cfg, run.out, run.step, run.policy
    run.ray_eval = out / "eval_spool" if cfg.uses_ray and cfg.eval.eval_num_gpus > 0 else None  # eval engines on Ray
    if cfg.rollout == "native":
        if dist.active():
            run.client = client_mod.ShardedNativeClient(policy)
        else:
            run.client = client_mod.make_rollout_client("native", model=policy)
    else:
        spool = Path(cfg.spool or out / "spool")
        dist.check_shared_dir(spool)  # torchrun: every rank writes requests there
        if dist.is_main():  # before the snapshot and the worker: a second trainer on this spool is refused at once
            run.spool_lock = client_mod.lock_trainer(spool)
        init_snapshot = out / "rollout_snapshots" / f"v{step}"
        save_snapshot(policy, init_snapshot)
        if cfg.spawn_worker and dist.is_main():
            run.worker = client_mod.spawn_worker(
                spool,
                gpu=cfg.rollout_gpu,
                log_path=out / "rollout_worker.log",
                model=run.model_path if cfg.lora.enabled else init_snapshot,
                weights_version=step,
                max_model_len=run.mcfg.max_position_embeddings,
                logprobs_mode=cfg.rollout_logprobs_mode,
                in_process=cfg.rollout_in_process,
                dtype=run.place.compute_dtype_name,
                extra_args=lora.worker_args(policy),
                engines=cfg.rollout_num_engines,
                engine_restarts=cfg.rollout_engine_restarts,
                use_fleet=cfg.uses_ray,
                ray_address=cfg.ray_address,
                eval_engines=cfg.eval.num_engines if run.ray_eval else 0,
                eval_gpus_per_engine=cfg.eval.eval_num_gpus_per_engine,
                eval_spool=run.ray_eval,
                eval_model=run.model_path,  # the step-0 weights, version 0: never deleted by the run (its snapshots are)
                eval_weights_version=0,
            )
        client = client_mod.make_rollout_client(
            "spool", spool=spool, timeout_s=cfg.rollout_timeout_s, worker=run.worker
        )
        run.client = client_mod.ShardedSpoolClient(client) if dist.active() else client
        if not cfg.spawn_worker or cfg.lora.enabled:  # an attached worker holds whatever it loaded last; LoRA: adapter
            run.client.sync_weights(init_snapshot, step)
    run.params = SamplingParams(
        n=cfg.group_size,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.max_tokens,
        stop_token_ids=run.stops,
    )
    if cfg.rollout == "spool" and (warning := logprob_basis_warning(run.client.logprob_basis, run.params)):
        log.warning(warning)


def _open_eval(run: Run) -> None:
    """Held-out prompts, scored in-process (blocking) or on snapshots (align.eval)."""
    from align.eval import EvalSet, make_evaluator
    from align.eval.evaluator import Evaluator
    from align.eval.fleet import EvalFleet
    from align.eval.metrics import score_completions, scored
    from align.rollout.protocol import SamplingParams

    cfg, policy, place, task = run.cfg, run.policy, run.place, run.task
    eval_t = cfg.temperature if cfg.eval.eval_temperature is None else cfg.eval.eval_temperature
    eval_sampling = SamplingParams(
        n=cfg.eval.eval_n,
        temperature=eval_t,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.eval.eval_max_tokens or cfg.max_tokens,
        stop_token_ids=run.stops,
        seed=cfg.seed,
    )
    eval_set = None
    if run.eval_encoded:

        def score(i: int, ids: list[int]) -> Any:
            return scored(
                *run.scorer.score([(task.eval_prompts[i], run.completion_text(ids))]).item(0), run.pass_reward
            )

        eval_set = EvalSet(run.eval_encoded, score, eval_sampling, name=run.task_name)

    if task.env is not None and task.eval_prompts:  # held-out episodes (align.run.episodes), in this process
        eval_set = EvalSet(
            [[0]] * len(task.eval_prompts),
            lambda i, ids: None,
            eval_sampling,
            name=run.task_name,
            episodes=lambda client, sampling: run.episodes.evaluate(run, sampling, client),
        )

    def blocking_eval(at_step: int) -> dict:
        from align.rollout.client import ShardedNativeClient

        if task.env is not None:
            policy.eval()
            return run.episodes.evaluate(run, eval_sampling)[0]
        from align.rollout.native import generate

        policy.eval()
        with place.autocast():  # as the training rollouts (bf16-mixed: bf16 matmuls)
            if dist.active():  # torchrun: every rank samples its share (the same completions), all score them
                comps = ShardedNativeClient(policy).generate(run.eval_encoded, eval_sampling)
            else:
                comps = generate(policy, run.eval_encoded, eval_sampling)
        return score_completions(run.eval_encoded, comps, eval_set.score, eval_sampling.n)

    def export(path: str) -> None:
        # LoRA: the adapter (the fleet serves it on the base model); merged for a CheckpointEvalFn's own backend
        lora.save_policy(
            run.eval_weights.pop() if dist.active() else policy,
            path,
            merge=cfg.eval.eval_function_path is not None,
            copy_tokenizer_from=cfg.data.tokenizer or run.model_path,
        )

    eval_cfg = cfg.eval
    if eval_set is None and not eval_cfg.uses_snapshots and eval_cfg.eval_interval > 0:
        log.info("no held-out prompts: in-process eval is off (pass eval_prompts=... or --eval-data to evaluate)")
        eval_cfg = replace(eval_cfg, eval_interval=0)
    run.eval_cfg, run.eval_set = eval_cfg, eval_set
    if dist.active() and not dist.is_main() and eval_cfg.uses_snapshots:  # torchrun: rank 0 alone dispatches
        run.evaluator = Evaluator(eval_cfg)
        return
    run.evaluator = make_evaluator(
        eval_cfg,
        eval_set,
        export_fn=export,
        blocking_eval_fn=blocking_eval if eval_set else None,
        should_stop=lambda: bool(run.stop_flag.get("signal")),
        reserved_gpus=[cfg.rollout_gpu],
        run_id=run.run_id,
        fleet=EvalFleet.on_ray_router(cfg.eval, run.ray_eval, run.worker) if run.ray_eval else None,
    )


def _open_pipeline(run: Run) -> None:
    """The rollout pipeline around ``collect`` (prompts -> rollouts -> rewards of one step); with K >= 1 and the
    shared engine, eval epochs pinned to one version (``align.eval.pinned``)."""
    from align.eval.pinned import pinned_evaluator
    from align.rollout.engines import generate_groups
    from align.rollout.groups import collect_groups
    from align.rollout.pipeline import make_pipeline

    cfg, task = run.cfg, run.task

    def collect(t: int, version: int, gen: Any) -> Any:
        """1-3 of step t: prompts -> rollouts (from weights ``version`` on client ``gen``) -> rewards."""

        def sample(idx: list[int], round_: int) -> list:
            # the seed depends only on (seed, step, round): resume replays a step exactly
            p = replace(run.params, seed=cfg.seed * 1_000_003 + t - 1 + round_ * 100_000_007)
            with run.place.autocast():  # the sampler computes like the trainer (bf16-mixed: bf16 matmuls)
                return generate_groups(gen, [run.encoded[i] for i in idx], p, cfg.max_inflight_requests)

        if task.env is not None:  # episodes (align.envs.episodes): the same stage, one conversation per sample
            return run.episodes.collect(t, gen, run)
        # a signal cuts the rewards at K = 0 in one process (a reward stuck in a sleep would hold the exit); K >= 1
        # abandons the producer instead (pipeline), and under torchrun every rank finishes the step (agree_on_signal)
        stop = None if run.pipe.is_async or dist.active() else run.pipe.should_stop
        # --adv-refill: more prompts until enough groups have signal
        score, names = (
            (unscored, [])
            if cfg.distill.distill_only
            else (lambda items, comps: run.scorer.score(items, stop), run.scorer.names)
        )
        return collect_groups(
            cfg.prompts_per_step,
            run.cursor.next_prompts,
            sample,
            lambda c: run.completion_text(c.token_ids),
            lambda i: task.prompts[i],
            score,
            names,
            cfg.adv_refill,
            cfg.max_refill_rounds,
        )

    snapshots = run.out / "rollout_snapshots"
    run.pipe = make_pipeline(cfg, collect, run.policy, run.client, run.step, run.cursor.state, run.pending, snapshots)
    run.pipe.should_stop = lambda: run.stop_flag.get("signal")  # its waits end on a signal (align.rollout.pipeline)
    run.evaluator = pinned_evaluator(run.pipe, run.evaluator, run.eval_set, cfg)  # K >= 1: eval on the engine
    if dist.is_main():
        run.progress = Progress(cfg.steps, start=run.step)
