"""Opening a training run: ``open_run(cfg, given, stop_flag) -> Run``, everything ``align.train.train``'s loop calls, built once.

Order (each step uses only what the steps before it made): validate the paths and the task (data, rewards,
tokenizer: bad input fails here, before the model loads); write ``config.json`` (a resumed run refuses changed
math); the policy, its reference and the resumed checkpoint; the optimizer and schedule; the run files; the rollout
backend (``--rollout``, a row of ``align.rollout.backends.BACKENDS``: the native sampler, or a spool worker it spawns
or attaches to); the evaluator; the rollout pipeline that the loop asks for each step's groups. The parts and the
``Run`` that holds them are ``align.run.parts``'; ``Run.close()`` tears them down in reverse (pipeline, rollout
backend, scorer, logs), after draining the evaluator.

Each component owns its cadence: ``Checkpointer.save(step, last_step=, force=)`` decides whether a checkpoint is
due, ``Run.eval_step`` asks the evaluator, ``RolloutPipeline.publish`` the rollout engine. Rank-0-only work under
torchrun sits in the run's sinks (``dist.RankLog`` on the other ranks), never in the loop.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from align import dist, learner, lora
from align import model as model_lib
from align.run import checkpoint as ckpt
from align.run import safety
from align.run.config import TrainConfig, lr_lambda
from align.run.log import MetricsLog, Progress, check_logger, make_logger
from align.run.parts import Learner, Run
from align.run.task import resolve_task
from align.run.teacher import check_teacher, open_teacher

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


# ------------------------------------------------------------------------------------------------ open_run


@dataclass
class Given:
    """What ``train()``'s caller passed (``align.train.train``'s keywords; None: the built-in task's or the flags')."""

    model: str | None = None
    tokenizer: Any = None
    prompts: list | None = None
    reward: Callable[..., float | None] | None = None
    eval_prompts: list | None = None
    env: Any = None
    tools: list | None = None


def open_run(cfg: TrainConfig, given: Given | None = None, stop_flag: dict | None = None) -> Run:
    """Build a ``Run`` (see the module docstring for the order). On a failure after parts started, they are closed."""
    from align.device import resolve as resolve_placement

    g = given or Given()
    run = Run(cfg, {} if stop_flag is None else stop_flag)
    run.owns_group = dist.setup(cfg)  # torchrun: the process group (no-op in one process)
    run.place = resolve_placement(cfg.device, cfg.precision)  # bad --device / --precision fail here, before any load
    try:
        _open_files_and_task(run, g.model, g.tokenizer, g.prompts, g.reward, g.eval_prompts, g.env, g.tools)
        _open_policy(run)
        _open_logs(run)
        _open_rollout(run)
        _open_eval(run)
        _open_pipeline(run)
        _open_watchdog(run)
    except BaseException as e:
        run.close(after_error=e)
        raise
    return run


def _open_files_and_task(
    run: Run, model: Any, tokenizer: Any, prompts: Any, reward: Any, eval_prompts: Any, env: Any, tools: Any
) -> None:
    from align.envs.sampler import open_sampler
    from align.eval.metrics import pass_reward_for
    from align.hub import resolve_model, resolve_tokenizer
    from align.rewards import make_scorer
    from align.run.sources import apply_backend_defaults

    cfg, out = run.cfg, run.out
    apply_backend_defaults(cfg)  # the Python API's config: the backend's defaults where nothing was said
    cfg.model, model = resolve_model(cfg.model), resolve_model(model, "model=")  # a hub id: its cached snapshot
    cfg.data.tokenizer = resolve_tokenizer(cfg.data.tokenizer)
    cfg.distill.teacher = resolve_model(cfg.distill.teacher, "--teacher")
    run.run_id, run.out_lock = safety.open_out(cfg, model or cfg.model)  # paths checked, --out locked, run id
    check_logger(cfg.log.logger, out)  # the --logger package imports, {out}/tensorboard is a dir
    run.task, run.model_path = resolve_task(cfg, model, tokenizer, prompts, reward, eval_prompts, env, tools)
    run.task_name = cfg.task if prompts is None and not cfg.data.train_data else "eval"
    task = run.task
    # the sampling seam (align.envs.sampler): an environment's open hook (a verifier pool) runs here, before the model
    sampler = run.sampler = open_sampler(cfg, task)
    rows = task.prompts + task.eval_prompts
    has_reward = task.reward is not None or cfg.rewards.reward
    needs_scorer = has_reward or not (sampler.terms or cfg.distill.distill_only)  # an environment rewards by itself
    run.scorer = sampler.scorer = make_scorer(cfg.rewards, task.reward, rows) if needs_scorer else None
    if run.scorer is not None:  # --group-timeout-s: each group scored in its own thread (align.rollout.deadlines)
        run.scorer.concurrent = cfg.group_timeout_s > 0
    check_teacher(cfg, run.model_path, task.tokenizer, task.prompts)  # --teacher: an HF dir, the same tokenizer
    run.pass_reward = None  # the reward that decides pass@k (--eval-pass-reward); refused before the model loads
    names = [*sampler.terms, *(run.scorer.names if run.scorer else [])]
    if task.eval_prompts and cfg.eval.eval_interval > 0:  # episodes: the environment's verdict decides by default
        run.pass_reward = pass_reward_for(names, cfg.eval.eval_pass_reward or next(iter(sampler.terms), None))
    write_config(cfg, out, run.model_path)


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


def _open_policy(run: Run) -> None:
    """Policy (resumed, LoRA, sharded), reference, optimizer, schedule; the prompts encoded and checked."""
    cfg, place, out = run.cfg, run.place, run.out
    run.encoded, run.eval_encoded = run.sampler.encode()  # an episode's first prompt is its reset(): no ids here
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
    run.learner = Learner(policy, ref_model, run.opt, run.sched, cfg, place, run.teacher)
    if not resume:
        torch.manual_seed(cfg.seed)


def load_policy(cfg: Any, place: Any, model_path: str, out: Path) -> tuple[torch.nn.Module, tuple | None, dict | None]:
    """(policy, the checkpoint to resume or None, its trainer state or None): the model of ``model_path`` (LoRA:
    frozen base + trainable adapters; a LoRA checkpoint holds only the adapter), or a resumed single-process
    checkpoint's; a sharded (torchrun) checkpoint is loaded into it after sharding (``open_optimizer``). Sets
    gradient checkpointing and the CPU threads."""
    from align.device import resolve_threads

    load = model_lib.load_pretrained  # looked up at call time (tests patch align.model.load_pretrained)
    resume = dist.main_first(partial(ckpt.pick, out / "checkpoints", cfg.resume_from))  # rank 0 moves later ones aside
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
    if hasattr(cfg, "moe"):  # MoE: --freeze-router (align.sft's config has no MoE section)
        cfg.moe.prepare(policy)
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
    """The rollout backend (``--rollout``, a row of ``align.rollout.backends.BACKENDS``) opened on the policy at the
    run's step: the native sampler, or a spool worker (spawned, or attached to); the sampling params and the
    logprob-basis warning."""
    from align.rollout.backends import BACKENDS, Target
    from align.rollout.protocol import SamplingParams

    cfg, out = run.cfg, run.out
    run.ray_eval = out / "eval_spool" if cfg.uses_ray and cfg.eval.eval_num_gpus > 0 else None  # eval engines on Ray
    target = Target(
        run.policy,
        out,
        run.step,
        run.model_path,
        run.mcfg.max_position_embeddings,
        run.place.compute_dtype_name,
        cfg.lora.enabled,
        eval_spool=run.ray_eval,
        eval_engines=cfg.eval.num_engines if run.ray_eval else 0,
        eval_gpus_per_engine=cfg.eval.eval_num_gpus_per_engine,
    )
    run.rollout = BACKENDS[cfg.rollout].open(cfg, target)
    run.params = SamplingParams(
        n=cfg.group_size,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.max_tokens,
        stop_token_ids=run.stops,
        min_p=cfg.min_p,
        repetition_penalty=cfg.repetition_penalty,
    )
    if warning := run.rollout.logprob_warning(run.params):
        log.warning(warning)


def eval_params(cfg: Any, stops: list[int]) -> Any:
    """How held-out prompts are sampled (``align.train`` and ``align.sft``): --eval-n, --eval-temperature (else the
    run's), --eval-max-tokens (else --max-tokens), the run's top-p / top-k, stop ids and seed."""
    from align.rollout.protocol import SamplingParams

    return SamplingParams(
        n=cfg.eval.eval_n,
        temperature=cfg.temperature if cfg.eval.eval_temperature is None else cfg.eval.eval_temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.eval.eval_max_tokens or cfg.max_tokens,
        stop_token_ids=stops,
        seed=cfg.seed,
    )


def _open_eval(run: Run) -> None:
    """Held-out prompts, scored in-process (blocking) or on snapshots (align.eval)."""
    from align.eval import EvalSet, make_evaluator
    from align.eval.evaluator import Evaluator
    from align.eval.fleet import EvalFleet
    from align.eval.metrics import score_completions, score_episodes

    cfg, policy, place, task = run.cfg, run.policy, run.place, run.task
    eval_sampling = eval_params(cfg, run.stops)
    eval_set = None
    if run.eval_encoded:
        eval_set = EvalSet(run.eval_encoded, run.score_eval, eval_sampling, name=run.task_name)

    def episodes(client: Any, sampling: Any) -> tuple[dict, list]:  # held-out episodes on any client, scored
        eps, scores = run.sampler.evaluate(client, sampling)
        return score_episodes(eps, scores, len(task.eval_prompts), sampling.n, run.pass_reward), eps

    if run.sampler.evaluate is not None and task.eval_prompts:  # held-out episodes: the sampler runs them
        eval_set = EvalSet([[0]] * len(task.eval_prompts), lambda i, ids: None, eval_sampling, run.task_name, episodes)

    def blocking_eval(at_step: int) -> dict:
        from align.rollout.client import NativeClient, ShardedNativeClient
        from align.rollout.native import generate

        policy.eval()
        if eval_set.episodes is not None:
            return eval_set.episodes(NativeClient(policy), eval_sampling)[0]
        with place.autocast():  # as the training rollouts (bf16-mixed: bf16 matmuls)
            if dist.active():  # torchrun: every rank samples its share (the same completions), all score them
                comps = ShardedNativeClient(policy).generate(run.eval_encoded, eval_sampling)
            else:
                comps = generate(policy, run.eval_encoded, eval_sampling)
        return score_completions(run.eval_encoded, comps, eval_set.score, eval_sampling.n)

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
        export_fn=run.export_eval,
        blocking_eval_fn=blocking_eval if eval_set else None,
        should_stop=run.signalled,
        reserved_gpus=[cfg.rollout_gpu],
        run_id=run.run_id,
        fleet=EvalFleet.on_ray_router(cfg.eval, run.ray_eval, run.worker) if run.ray_eval else None,
    )


def _open_watchdog(run: Run) -> None:
    """--stall-timeout-s: the watchdog thread (``align.run.watchdog``); a spool worker's heartbeat goes in stall.txt."""
    from align.run.watchdog import Watchdog

    run.watchdog = Watchdog(run.out, run.cfg.stall_after_s, run.stop_flag)
    spool = getattr(run.client, "spool", None)
    if spool is not None:
        run.watchdog.reports.append((f"rollout worker heartbeat ({spool.root})", spool.read_heartbeat))
    run.watchdog.start()


def _open_pipeline(run: Run) -> None:
    """The rollout pipeline around ``collect`` (prompts -> rollouts -> rewards of one step); with K >= 1 and the
    shared engine, eval epochs pinned to one version (``align.eval.pinned``)."""
    from align.eval.pinned import pinned_evaluator
    from align.rollout.pipeline import make_pipeline

    cfg = run.cfg
    run.sampler.start(
        params=run.params,
        cursor=run.cursor,
        encoded=run.encoded,
        decode=run.completion_text,
        context=run.mcfg.max_position_embeddings,
        autocast=run.place.autocast,
    )

    def collect(t: int, version: int, gen: Any) -> Any:
        """1-3 of step t: prompts -> rollouts (from weights ``version`` on client ``gen``) -> rewards."""
        # a signal cuts the rewards at K = 0 in one process (a reward stuck in a sleep would hold the exit); K >= 1
        # abandons the producer instead (pipeline), and under torchrun every rank finishes the step (agree_on_signal)
        return run.sampler.collect(t, gen, None if run.pipe.is_async or dist.active() else run.pipe.should_stop)

    snapshots = run.out / "rollout_snapshots"
    run.pipe = make_pipeline(cfg, collect, run.rollout, run.step, run.cursor.state, run.pending, snapshots)
    run.pipe.should_stop = run.signalled  # its waits end on a signal (align.rollout.pipeline)
    run.evaluator = pinned_evaluator(run.pipe, run.evaluator, run.eval_set, cfg)  # K >= 1: eval on the engine
    if dist.is_main():
        run.progress = Progress(cfg.steps, start=run.step)
