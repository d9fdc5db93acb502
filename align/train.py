"""GRPO training: the training loop ``train()`` and the CLI ``python -m align.train`` (settings: ``align.config``).

One step, top to bottom: prompts -> rollouts (a rollout client: the native sampler, or a vLLM worker
through the spool) -> rewards -> group advantages -> micro-batched loss/backward with global
normalisers (so the micro-batch size never changes the gradient) -> clip -> AdamW step -> log ->
checkpoint / eval. With no arguments it trains the built-in ``reverse`` task on a CPU in minutes
(see ``align/tasks/reverse.py``).

Python API::

    from align.train import TrainConfig, train
    train(TrainConfig(out="runs/mine", steps=100), model="path/to/hf_dir", tokenizer=tok,
          prompts=[{"prompt": "...", "answer": "..."}, ...], reward=my_reward)

``reward(prompt, completion, **fields) -> float | None``: ``fields`` are the prompt dict's other keys;
``None``/NaN or an exception marks the completion unscorable (no gradient, counted in the stats).
"""

from __future__ import annotations

import logging
import math
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from align import runsafety
from align.config import CLI_PREFIXES, TrainConfig
from align.data import InputError

log = logging.getLogger(__name__)

RESERVED_PROMPT_KEYS = ("prompt",)
SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}


# ------------------------------------------------------------------------------------------------ data


@dataclass
class Task:
    """What to learn: prompt dicts, a tokenizer, a reward, held-out prompts."""

    prompts: list[dict]
    tokenizer: Any
    reward: Callable[..., float | None]
    eval_prompts: list[dict] = field(default_factory=list)


def builtin_task(cfg: TrainConfig) -> tuple[Task, str]:
    """The built-in task and its warm-started model dir (built once, under {out}/base_model)."""
    if cfg.task != "reverse":
        raise ValueError(f"unknown built-in task {cfg.task!r}; available: 'reverse'")
    from align.atomic import is_committed
    from align.tasks import reverse

    task = Task(
        reverse.prompts(5000, "train", cfg.seed),
        reverse.tokenizer(),
        reverse.reward,
        reverse.prompts(cfg.eval_prompts, "eval", cfg.seed),
    )
    base = Path(cfg.out) / "base_model"
    if cfg.model is not None:
        if not (Path(cfg.model) / "align_tokenizer.json").is_file():
            raise InputError(
                f"--model {cfg.model} is not a model of the built-in {cfg.task!r} task (it has no "
                "align_tokenizer.json); to train it on your data pass --train-data FILE.jsonl and "
                "--reward FILE.py:FUNCTION (and --eval-data FILE.jsonl to evaluate)"
            )
        return task, cfg.model
    if not is_committed(base):
        print(
            f"[align] warm start: {cfg.warm_start_steps} supervised steps on the biased copy/reverse mixture -> {base}",
            flush=True,
        )
        reverse.warm_start(
            base, steps=cfg.warm_start_steps, seed=cfg.seed, log=lambda s: print(f"[align] {s}", flush=True)
        )
    return task, str(base)


def as_records(prompts: list) -> list[dict]:
    out = []
    for i, p in enumerate(prompts):
        rec = {"prompt": p} if isinstance(p, str) else dict(p)
        if not isinstance(rec.get("prompt"), str):
            raise ValueError(f"prompt {i} must be a str or a dict with a 'prompt' str, got {type(p).__name__}")  # noqa: TRY004
        out.append(rec)
    if not out:
        raise ValueError("no prompts to train on")
    return out


def batch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
    return order


def stop_ids(tokenizer: Any, model_cfg: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = model_cfg.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def score(reward: Callable, rec: dict, completion: str, errors: list[str]) -> float:
    fields = {k: v for k, v in rec.items() if k not in RESERVED_PROMPT_KEYS}
    try:
        r = reward(rec["prompt"], completion, **fields)
    except Exception:  # noqa: BLE001 - a user's reward function: counted as unscorable, the run goes on
        errors.append(traceback.format_exc())
        return math.nan
    return math.nan if r is None else float(r)


# ------------------------------------------------------------------------------------------------ loop


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        decay = 1 - frac if cfg.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return f


def train(
    cfg: TrainConfig,
    *,
    model: str | None = None,
    tokenizer: Any = None,
    prompts: list | None = None,
    reward: Callable[..., float | None] | None = None,
    eval_prompts: list | None = None,
    stop_flag: dict | None = None,
) -> dict:
    """Run GRPO; returns a summary dict. Resumes from the last committed checkpoint under ``cfg.out``.

    ``stop_flag`` (set by ``main``'s signal handlers: {"signal": signum}) makes the loop checkpoint after
    the current step and return early with ``summary["interrupted"] = signum``."""
    import torch

    from align import checkpoint as ckpt
    from align import dist, dist_checkpoint, learner, lora
    from align.device import make_optimizer, resolve_threads
    from align.device import resolve as resolve_placement
    from align.eval import EvalSet, make_evaluator
    from align.eval.fleet import EvalFleet
    from align.eval.metrics import score_completions, scored
    from align.eval.pinned import pinned_evaluator
    from align.grpo import compute_advantages
    from align.model import load_pretrained
    from align.pipeline import generate_groups, make_pipeline
    from align.rollout.client import make_rollout_client, spawn_worker
    from align.rollout.protocol import SamplingParams, atomic_write_text, logprob_basis_warning
    from align.runlog import MetricsLog, Progress, format_line, make_logger, sample_groups, write_plot

    t_start = time.monotonic()
    owns_group = dist.setup(cfg)  # torchrun: the process group (no-op in one process)
    place = resolve_placement(cfg.device, cfg.precision)  # bad --device / --precision fail here, before any load
    stop_flag = stop_flag if stop_flag is not None else {}
    out = Path(cfg.out)
    runsafety.check_paths(cfg.out, model or cfg.model, cfg.save_hf, cfg.eval.eval_hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_id = dist.main_first(lambda: runsafety.run_id(out))
    if cfg.save_hf:
        runsafety.check_export_target(cfg.save_hf, run_id, cfg.overwrite)
    if prompts is None and cfg.data.train_data:  # your own data from files (align.data); rewards from --reward
        if not (model or cfg.model):
            raise InputError("--train-data needs --model DIR (a Hugging Face checkpoint directory)")
        from align.data import load_data

        tokenizer, prompts, eval_prompts = load_data(cfg.data, model or cfg.model, cfg.max_tokens)
    has_reward = reward is not None or bool(cfg.rewards.reward)
    if (prompts is None) == has_reward or (prompts is not None and tokenizer is None):
        raise InputError(
            "pass prompts, tokenizer and reward together (CLI: --train-data and --reward), or none of "
            "them for the built-in task"
        )
    if prompts is None:
        task, model_path = dist.main_first(lambda: builtin_task(cfg))
    else:
        task = Task(as_records(prompts), tokenizer, reward, as_records(eval_prompts) if eval_prompts else [])
        model_path = model or cfg.model
        if model_path is None:
            raise ValueError("no model: pass model=<HF checkpoint dir> or --model")
    from align.eval.metrics import pass_reward_for
    from align.rewards import make_scorer
    from align.rollout.groups import collect_groups

    scorer = make_scorer(cfg.rewards, task.reward, task.prompts + task.eval_prompts)
    pass_reward = None  # the reward that decides pass@k (--eval-pass-reward); refused before the model loads
    if task.eval_prompts and cfg.eval.eval_interval > 0:
        pass_reward = pass_reward_for(scorer.names, cfg.eval.eval_pass_reward)
    import json

    new_config = {**asdict(cfg), "model": model_path}
    if ckpt.latest(out / "checkpoints"):  # resuming: refuse changed math, apply (and log) operational changes
        for change in runsafety.check_resume_config(out / "config.json", new_config):
            print(f"[align] resume: applying changed setting {change}", flush=True)
    if dist.is_main():
        atomic_write_text(out / "config.json", json.dumps(new_config, indent=2))

    resume = dist.main_first(lambda: ckpt.pick(out / "checkpoints", cfg.resume_from))  # rank 0 moves later ones aside
    if cfg.lora.enabled:  # frozen base + trainable adapters; a LoRA checkpoint holds only the adapter
        policy = load_pretrained(model_path, dtype=place.param_dtype, device=place.device)
        lora.apply_lora(policy, cfg.lora, base_model=model_path, seed=cfg.seed)
        if resume:
            lora.load_adapter(policy, resume[1] / "adapter")
    elif resume and not dist_checkpoint.is_sharded(resume[1]):
        policy = ckpt.load_model(resume[1], place.param_dtype, device=place.device)
    else:  # a sharded (torchrun) checkpoint is loaded into this model after sharding
        policy = load_pretrained(model_path, dtype=place.param_dtype, device=place.device)
    state = ckpt.load_state(resume[1]) if resume else None
    if resume and dist_checkpoint.is_sharded(resume[1]):  # on every rank, before any collective
        dist_checkpoint.check_model_config(resume[1], state, policy)
    policy.gradient_checkpointing = cfg.gradient_checkpointing
    mcfg = policy.config
    torch.set_num_threads(resolve_threads(cfg.threads))  # --threads 0: OMP_NUM_THREADS, else every CPU
    ref_model = None
    if cfg.loss.kl_coef > 0 and cfg.lora.enabled:  # the policy with its adapters off is the frozen base: no 2nd copy
        ref_model = policy  # (align.learner.reference_logprobs runs it inside align.lora.adapters_disabled)
    elif cfg.loss.kl_coef > 0:
        ref_model = load_pretrained(model_path, dtype=place.frozen_dtype, device=place.device).requires_grad_(False)
    tok = task.tokenizer
    stops = stop_ids(tok, mcfg)
    encoded = [tok.encode(r["prompt"]) for r in task.prompts]
    eval_encoded = [tok.encode(r["prompt"]) for r in task.eval_prompts]
    for i, ids in enumerate(encoded + eval_encoded):
        if len(ids) + cfg.max_tokens > mcfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} ({len(ids)} tokens) + --max-tokens {cfg.max_tokens} does not fit the model's context "
                f"of {mcfg.max_position_embeddings}; shorten it or lower --max-tokens"
            )
    learner.check_token_budget(cfg, [len(ids) for ids in encoded])

    policy, ref_model = dist.shard(policy, place.precision), ref_model and dist.shard(ref_model, place.precision)
    opt = make_optimizer(
        lora.trainable_parameters(policy), place, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    step, cursor, pending = 0, {"epoch": 0, "index": 0}, []
    if resume:  # any world size resumes any checkpoint (DCP resharding, or the full single-process state)
        dist_checkpoint.restore_any(resume[1], state, policy, opt)
        sched.load_state_dict(state["scheduler"])
        step, cursor, pending = state["step"], state["cursor"], state.get("pending_batches", [])
        print(f"[align] resuming from {resume[1]} (step {step})", flush=True)
    logs = (
        MetricsLog(out / n, resume_step=step if resume else 0) if dist.is_main() else dist.RankLog()
        for n in ("metrics.jsonl", "completions.jsonl")
    )  # torchrun: rank 0 alone writes run files
    metrics, samples = logs
    if dist.is_main() and (sink := make_logger(cfg.log.logger, out, asdict(cfg), step)) is not None:
        metrics.sinks.append(sink)
    if not resume:
        torch.manual_seed(cfg.seed)

    # Rollout client.
    worker = None
    ray_eval = out / "eval_spool" if cfg.uses_ray and cfg.eval.eval_num_gpus > 0 else None  # eval engines on Ray

    def publish(snap: Path) -> None:  # torchrun: gathered to rank 0's CPU, written by it; every rank waits for it
        full = dist.full_model(policy, to_main_cpu=True)
        if dist.is_main():
            lora.save_policy(full, snap)  # LoRA: the adapter only, served on the base model
        dist.barrier()

    if cfg.rollout == "native":
        client = dist.ShardedNativeClient(policy) if dist.active() else make_rollout_client("native", model=policy)
    else:
        spool = Path(cfg.spool or out / "spool")
        dist.check_shared_dir(spool)  # torchrun: every rank writes requests there
        init_snapshot = out / "rollout_snapshots" / f"v{step}"
        publish(init_snapshot)
        if cfg.spawn_worker and dist.is_main():
            worker = spawn_worker(
                spool,
                gpu=cfg.rollout_gpu,
                log_path=out / "rollout_worker.log",
                model=model_path if cfg.lora.enabled else init_snapshot,
                weights_version=step,
                max_model_len=mcfg.max_position_embeddings,
                logprobs_mode=cfg.rollout_logprobs_mode,
                in_process=cfg.rollout_in_process,
                dtype=place.compute_dtype_name,
                extra_args=lora.worker_args(policy),
                engines=cfg.rollout_num_engines,
                engine_restarts=cfg.rollout_engine_restarts,
                use_fleet=cfg.uses_ray,
                ray_address=cfg.ray_address,
                eval_engines=cfg.eval.num_engines if ray_eval else 0,
                eval_gpus_per_engine=cfg.eval.eval_num_gpus_per_engine,
                eval_spool=ray_eval,
                eval_model=model_path,  # the step-0 weights, version 0: never deleted by the run (its snapshots are)
                eval_weights_version=0,
            )
        client = make_rollout_client("spool", spool=spool, timeout_s=cfg.rollout_timeout_s, worker=worker)
        client = dist.ShardedSpoolClient(client) if dist.active() else client
        if (
            not cfg.spawn_worker or cfg.lora.enabled
        ):  # an attached worker holds whatever it loaded last; LoRA: the adapter
            client.sync_weights(init_snapshot, step)
    params = SamplingParams(
        n=cfg.group_size,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.max_tokens,
        stop_token_ids=stops,
    )
    if cfg.rollout == "spool" and (warning := logprob_basis_warning(client.logprob_basis, params)):
        log.warning(warning)

    # Eval: held-out prompts, scored in-process (blocking) or on snapshots (align.eval).
    def completion_text(ids: list[int]) -> str:
        return tok.decode(ids[:-1] if ids and ids[-1] in stops else ids)

    eval_t = cfg.temperature if cfg.eval.eval_temperature is None else cfg.eval.eval_temperature
    eval_sampling = SamplingParams(
        n=cfg.eval.eval_n,
        temperature=eval_t,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.eval.eval_max_tokens or cfg.max_tokens,
        stop_token_ids=stops,
        seed=cfg.seed,
    )
    eval_set = None
    if eval_encoded:
        eval_set = EvalSet(
            eval_encoded,
            lambda i, ids: scored(*scorer.score([(task.eval_prompts[i], completion_text(ids))]).item(0), pass_reward),
            eval_sampling,
            name=cfg.task if prompts is None else "eval",
        )

    def blocking_eval(at_step: int) -> dict:
        policy.eval()
        from align.rollout.native import generate

        with place.autocast():  # as the training rollouts (bf16-mixed: bf16 matmuls)
            if dist.active():  # torchrun: every rank samples its share (the same completions), all score them
                comps = dist.ShardedNativeClient(policy).generate(eval_encoded, eval_sampling)
            else:
                comps = generate(policy, eval_encoded, eval_sampling)
        return score_completions(eval_encoded, comps, eval_set.score, eval_sampling.n)

    eval_weights: list = []  # torchrun: the eval step's weights, gathered to rank 0's CPU by every rank

    def export(path: str) -> None:
        # LoRA: the adapter (the fleet serves it on the base model); merged for a CheckpointEvalFn's own backend
        lora.save_policy(
            eval_weights.pop() if dist.active() else policy,
            path,
            merge=cfg.eval.eval_function_path is not None,
            copy_tokenizer_from=cfg.data.tokenizer or model_path,
        )

    eval_cfg = cfg.eval
    if eval_set is None and not eval_cfg.uses_snapshots and eval_cfg.eval_interval > 0:
        log.info("no held-out prompts: in-process eval is off (pass eval_prompts=... or --eval-data to evaluate)")
        eval_cfg = replace(eval_cfg, eval_interval=0)
    from align.eval.evaluator import Evaluator

    if dist.active() and not dist.is_main() and eval_cfg.uses_snapshots:  # torchrun: rank 0 alone dispatches
        evaluator = Evaluator(eval_cfg)
    else:
        evaluator = make_evaluator(
            eval_cfg,
            eval_set,
            export_fn=export,
            blocking_eval_fn=blocking_eval if eval_set else None,
            should_stop=lambda: bool(stop_flag.get("signal")),
            reserved_gpus=[cfg.rollout_gpu],
            fleet=EvalFleet.on_ray_router(cfg.eval, ray_eval, worker) if ray_eval else None,
        )

    def save_checkpoint() -> None:  # torchrun: each rank writes its DCP shards, rank 0 commits (align.dist_checkpoint)
        extra = {"scheduler": sched.state_dict(), **pipe.checkpoint_state(step, cursor)}
        dist_checkpoint.save_any(out / "checkpoints", step, policy, opt, extra, cfg.keep_checkpoints)

    def emit_eval(records: list[dict]) -> None:
        for r in records:
            metrics.write(r)
            if dist.is_main():
                print(format_line(r), flush=True)

    def next_prompts(n: int) -> list[int]:
        order = batch_order(len(task.prompts), cfg.seed, cursor["epoch"])
        idx = []
        while len(idx) < n:
            if cursor["index"] >= len(order):
                cursor["epoch"] += 1
                cursor["index"] = 0
                order = batch_order(len(task.prompts), cfg.seed, cursor["epoch"])
            idx.append(order[cursor["index"]])
            cursor["index"] += 1
        return idx

    def collect(t: int, version: int, gen: Any) -> Any:
        """1-3 of step t: prompts -> rollouts (from weights ``version`` on client ``gen``) -> rewards."""

        def sample(idx: list[int], round_: int) -> list:
            # the seed depends only on (seed, step, round): resume replays a step exactly
            p = replace(params, seed=cfg.seed * 1_000_003 + t - 1 + round_ * 100_000_007)
            with place.autocast():  # the sampler computes like the trainer (bf16-mixed: bf16 matmuls)
                comps = generate_groups(gen, [encoded[i] for i in idx], p, cfg.max_inflight_requests)
            if cfg.rollout == "spool":
                runsafety.check_weights_version(comps, version, gen.spool.root)
            return comps

        # --adv-refill: more prompts until enough groups have signal
        return collect_groups(
            cfg.prompts_per_step,
            next_prompts,
            sample,
            completion_text,
            lambda i: task.prompts[i],
            scorer,
            cfg.adv_refill,
            cfg.max_refill_rounds,
        )

    pipe = make_pipeline(cfg, collect, policy, client, step, cursor, pending, out / "rollout_snapshots")
    evaluator = pinned_evaluator(pipe, evaluator, eval_set, cfg)  # K >= 1: eval on the engine, one version each

    progress = Progress(cfg.steps, start=step) if dist.is_main() else dist.RankLog()
    first_error: list[str] = []

    def baseline_dir() -> str:
        """The step-0 snapshot: the base model; in LoRA mode with an eval fleet the untrained adapter (written once,
        atomically, before step 1), so the fleet starts its engines with LoRA enabled for every later point."""
        if not (cfg.lora.enabled and cfg.eval.eval_num_gpus > 0 and not cfg.eval.eval_function_path):
            return model_path
        step0 = out / "lora_step0_adapter"
        if not resume and not (step0 / "adapter_config.json").exists():
            lora.save_policy(policy, step0)
        return str(step0) if (step0 / "adapter_config.json").exists() else model_path

    train_error = None
    try:
        if eval_set:  # the step-0 baseline, once per run, through the evaluator's own path
            emit_eval(evaluator.baseline(baseline_dir(), written=metrics.records, resumed=bool(resume)))
        while step < cfg.steps:
            t0 = time.monotonic()
            policy.train()
            # 1-3. prompts -> rollouts -> rewards (align.pipeline: this thread, or K steps ahead on a producer)
            batch, async_stats = pipe.next(step + 1)
            t_rollout, batch = batch.seconds, batch.batch  # generation + rewards where they ran (not the wait)
            idx, completions, scores, errors = batch.idx, batch.completions, batch.scores, batch.scores.errors
            batch_ids = [encoded[i] for i in idx]
            P, G = len(idx), cfg.group_size
            rewards = torch.full((P, G), math.nan)
            terms = {n: torch.full((P, G), math.nan) for n in scores.terms}
            for j, c in enumerate(completions):
                rewards[c.prompt_index, c.sample_index] = scores.totals[j]
                for n, v in scores.terms.items():
                    terms[n][c.prompt_index, c.sample_index] = v[j]
            failures = errors or [f"{scores.timeouts} reward call(s) timed out (--reward-timeout-s)"]
            if scores.failed and not first_error:
                first_error.append(failures[0])
                log.warning("a reward call failed; the completion counts as unscorable:\n%s", failures[0])
            if scores.failed == batch.scored:
                raise RuntimeError(
                    f"the reward function raised on every completion of step {step + 1}; first error:\n{failures[0]}"
                )
            # 4. advantages
            lengths = torch.zeros(P, G)
            truncated = torch.zeros(P, G, dtype=torch.bool)
            for c in completions:
                lengths[c.prompt_index, c.sample_index] = len(c.token_ids)
                truncated[c.prompt_index, c.sample_index] = c.finish_reason == "length"
            adv, valid, adv_stats = compute_advantages(
                rewards, cfg.adv, lengths=lengths, truncated=truncated, max_tokens=cfg.max_tokens
            )
            # 5. loss / backward / optimizer step(s) on the device (align.learner: fused logprobs, micro-batches
            #    with global normalisers, updates per batch)
            upd = learner.update(policy, ref_model, opt, cfg, place, batch_ids, completions, adv, valid)
            sched.step()
            step += 1
            # 6. weights to the rollout worker
            if pipe.is_async:
                sync_s = pipe.publish(step, policy)
            elif cfg.rollout == "spool" and step % cfg.sync_every == 0:
                snap = out / "rollout_snapshots" / f"v{step}"
                publish(snap)
                sync_s = client.sync_weights(snap, step)
                pipe.published = step
                prev = out / "rollout_snapshots" / f"v{step - cfg.sync_every}"
                if prev.exists() and dist.is_main():
                    import shutil

                    shutil.rmtree(prev, ignore_errors=True)
            else:
                sync_s = 0.0
            # 7. log
            gen_tokens = sum(len(c.token_ids) for c in completions)
            dt = time.monotonic() - t0
            finite = rewards[~rewards.isnan()]
            rec = {
                "step": step,
                "reward_mean": float(finite.mean()) if finite.numel() else math.nan,
                "reward_std": float(finite.std()) if finite.numel() > 1 else 0.0,
                **upd.stats,
                **adv_stats,
                "unscorable": int(rewards.isnan().sum()),
                "reward_errors": len(errors),
                "reward_timeouts": scores.timeouts,
                **{
                    f"reward/{n}_mean": float(v[~v.isnan()].mean()) if (~v.isnan()).any() else math.nan
                    for n, v in terms.items()
                },
                **(
                    {
                        "refill_rounds": batch.rounds,
                        "refill_prompts": batch.sampled_prompts - P,
                        "signal_groups": batch.signal_groups,
                    }
                    if cfg.adv_refill
                    else {}
                ),
                "completion_len_mean": gen_tokens / len(completions),
                "truncated_frac": float(truncated.float().mean()),
                "tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
                "rollout_time": t_rollout,
                "sync_time": sync_s,
                "step_time": dt,
                "lr": sched.get_last_lr()[0],
                "grad_norm": upd.grad_norm,
                **async_stats,
            }
            metrics.write(rec)
            progress.update(step, format_line(rec))
            if cfg.log.log_completions_every and step % cfg.log.log_completions_every == 0:
                for r in sample_groups(
                    step,
                    [task.prompts[i]["prompt"] for i in idx],
                    completions,
                    batch.texts,
                    rewards,
                    adv,
                    terms,
                    cfg.log.log_completions_groups,
                ):
                    samples.write(r)
            # 8. eval and checkpoint
            is_final = step == cfg.steps
            if dist.active() and eval_cfg.uses_snapshots and eval_cfg.is_due(step, is_final):
                eval_weights[:] = [dist.full_model(policy, to_main_cpu=True)]  # a collective: all ranks, same step
            emit_eval(evaluator.step(step, is_final) + evaluator.poll())
            dist.agree_on_signal(stop_flag)  # torchrun: a signal seen by any rank stops every rank after this step
            if is_final or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stop_flag.get("signal"):
                save_checkpoint()
                if dist.is_main():
                    write_plot(out / "plot.svg", metrics.records, title=f"align GRPO: {out.name}")
            if stop_flag.get("signal"):
                break
    except BaseException as e:
        train_error = e
        raise
    finally:
        progress.close()
        try:
            emit_eval(evaluator.drain(after_error=train_error))
        finally:
            pipe.close()
            client.close()
            scorer.close()
            metrics.close()
            if worker is not None:
                worker.shutdown()
    if cfg.save_hf and step == cfg.steps:
        full = dist.full_model(policy, to_main_cpu=True)  # torchrun: streamed to rank 0's CPU, written by it
        if dist.is_main():
            runsafety.export_hf(
                lambda d: lora.save_policy(
                    full, d, merge=cfg.merge_lora, copy_tokenizer_from=cfg.data.tokenizer or model_path
                ),
                cfg.save_hf,
                run_id,
                cfg.overwrite,
                step,
            )
    if dist.is_main():
        write_plot(out / "plot.svg", metrics.records, title=f"align GRPO: {out.name}")
    evals = [r for r in metrics.records if "eval/pass@1" in r]
    summary = {
        "steps": step,
        "eval_start": evals[0]["eval/pass@1"] if evals else None,
        "eval_end": evals[-1]["eval/pass@1"] if evals else None,
        "wall_s": time.monotonic() - t_start,
        "out": str(out),
        "interrupted": stop_flag.get("signal"),
    }
    dist.teardown(owns_group)  # torchrun: the group train() created ends with it
    return summary


def print_summary(s: dict) -> None:
    acc = ""
    if s["eval_start"] is not None:
        acc = f"held-out pass@1 {s['eval_start']:.3f} -> {s['eval_end']:.3f} | "
    print(
        f"[align] done: {s['steps']} steps | {acc}wall {s['wall_s']:.0f}s | run dir {s['out']} "
        f"(config.json, metrics.jsonl, plot.svg, checkpoints/)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    from align.presets import parse

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse(TrainConfig, argv, CLI_PREFIXES, description=__doc__.split("\n\n")[0])
    stop_flag: dict = {}

    def on_signal(signum, frame):
        if stop_flag.get("signal"):  # second signal: stop now
            raise KeyboardInterrupt
        stop_flag["signal"] = signum
        print(f"\n[align] got signal {signum}: finishing this step, writing a checkpoint, then exiting", flush=True)

    old = {s: signal.signal(s, on_signal) for s in SIGNAL_EXIT}
    try:
        summary = train(cfg, stop_flag=stop_flag)
    except InputError as e:  # bad data / reward / tokenizer input, found before the model loads
        print(f"align.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    from align.dist import is_main

    if is_main():  # torchrun: one summary line
        print_summary(summary)
    if summary["interrupted"]:
        return SIGNAL_EXIT[summary["interrupted"]]
    return 0


if __name__ == "__main__":
    sys.exit(main())
