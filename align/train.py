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
    from align.model import is_committed
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
    from align import dist, learner, lora
    from align.device import make_optimizer, resolve_threads
    from align.device import resolve as resolve_placement
    from align.eval import EvalSet, make_evaluator
    from align.eval.metrics import score_completions
    from align.grpo import compute_advantages
    from align.model import load_pretrained
    from align.rollout.client import make_rollout_client, spawn_worker
    from align.rollout.protocol import SamplingParams, atomic_write_text, logprob_basis_warning
    from align.runlog import MetricsLog, Progress, format_line, make_logger, sample_groups, write_plot

    t_start = time.monotonic()
    dist.setup(cfg)  # torchrun: the process group (no-op in one process)
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
    from align.rewards import collect_groups, make_scorer

    scorer = make_scorer(cfg.rewards, task.reward, task.prompts + task.eval_prompts)
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
    elif resume:
        policy = ckpt.load_model(resume[1], place.param_dtype, device=place.device)
    else:
        policy = load_pretrained(model_path, dtype=place.param_dtype, device=place.device)
    policy.gradient_checkpointing = cfg.gradient_checkpointing
    mcfg = policy.config
    torch.set_num_threads(resolve_threads(cfg.threads, mcfg.num_params()))  # --threads 0: from the model size
    ref_model = None
    if cfg.loss.kl_coef > 0:
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
    step, cursor = 0, {"epoch": 0, "index": 0}
    if resume:
        state = ckpt.load_state(resume[1])
        dist.restore_optimizer(policy, opt, state, resume[1])
        sched.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        step, cursor = state["step"], state["cursor"]
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
    if cfg.rollout == "native":
        client = dist.ShardedNativeClient(policy) if dist.active() else make_rollout_client("native", model=policy)
    else:
        spool = Path(cfg.spool or out / "spool")
        init_snapshot = out / "rollout_snapshots" / f"v{step}"
        lora.save_policy(policy, init_snapshot)  # LoRA: the adapter only, served on the base model
        if cfg.spawn_worker:
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
            )
        client = make_rollout_client("spool", spool=spool, timeout_s=cfg.rollout_timeout_s, worker=worker)
        if (
            not cfg.spawn_worker or cfg.lora.enabled
        ):  # an attached worker holds whatever it loaded last; LoRA: the adapter
            client.sync_weights(init_snapshot, step)
    published = step  # the weights version every rollout must come from
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
            lambda i, ids: scorer.score([(task.eval_prompts[i], completion_text(ids))]).totals[0],
            eval_sampling,
            name=cfg.task if prompts is None else "eval",
        )

    def blocking_eval(at_step: int) -> dict:
        policy.eval()
        from align.rollout.native import generate

        with place.autocast():  # as the training rollouts (bf16-mixed: bf16 matmuls)
            comps = generate(policy, eval_encoded, eval_sampling)
        return score_completions(eval_encoded, comps, eval_set.score, eval_sampling.n)

    def export(path: str) -> None:
        # LoRA: the adapter (the fleet serves it on the base model); merged for a CheckpointEvalFn's own backend
        lora.save_policy(
            policy,
            path,
            merge=cfg.eval.eval_function_path is not None,
            copy_tokenizer_from=cfg.data.tokenizer or model_path,
        )

    eval_cfg = cfg.eval
    if eval_set is None and not eval_cfg.uses_snapshots and eval_cfg.eval_interval > 0:
        log.info("no held-out prompts: in-process eval is off (pass eval_prompts=... or --eval-data to evaluate)")
        eval_cfg = replace(eval_cfg, eval_interval=0)
    evaluator = make_evaluator(
        eval_cfg,
        eval_set,
        export_fn=export,
        blocking_eval_fn=blocking_eval if eval_set else None,
        should_stop=lambda: bool(stop_flag.get("signal")),
        reserved_gpus=[cfg.rollout_gpu],
    )

    def save_checkpoint() -> None:  # torchrun: every rank gathers, rank 0 writes, the others wait for the marker
        weights, opt_state = dist.full_model(policy), dist.optimizer_state(policy, opt)
        if dist.is_main():
            ckpt.save(out / "checkpoints", step, weights, {"optimizer": opt_state, "scheduler": sched.state_dict(),
                                                         "cursor": dict(cursor)}, cfg.keep_checkpoints)  # fmt: skip
        dist.barrier()

    def emit_eval(records: list[dict]) -> None:
        for r in records:
            metrics.write(r)
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

    def sample(idx: list[int], round_: int) -> list:
        # the seed depends only on (seed, step, round): resume replays a step exactly
        params.seed = cfg.seed * 1_000_003 + step + round_ * 100_000_007
        with place.autocast():  # the sampler computes like the trainer (bf16-mixed: bf16 matmuls)
            comps = client.generate([encoded[i] for i in idx], params)
        if cfg.rollout == "spool":
            runsafety.check_weights_version(comps, published, client.spool.root)
        return comps

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
            # 1-3. prompts -> rollouts -> rewards (--adv-refill: more prompts until enough groups have signal)
            batch = collect_groups(
                cfg.prompts_per_step,
                next_prompts,
                sample,
                completion_text,
                lambda i: task.prompts[i],
                scorer,
                cfg.adv_refill,
                cfg.max_refill_rounds,
            )
            idx, completions, scores, errors = batch.idx, batch.completions, batch.scores, batch.scores.errors
            batch_ids = [encoded[i] for i in idx]
            t_rollout = time.monotonic() - t0
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
            if cfg.rollout == "spool" and step % cfg.sync_every == 0:
                snap = out / "rollout_snapshots" / f"v{step}"
                lora.save_policy(policy, snap)
                sync_s = client.sync_weights(snap, step)
                published = step
                prev = out / "rollout_snapshots" / f"v{step - cfg.sync_every}"
                if prev.exists():
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
            client.close()
            scorer.close()
            metrics.close()
            if worker is not None:
                worker.shutdown()
    if cfg.save_hf and step == cfg.steps:
        full = dist.full_model(policy)  # torchrun: gathered by every rank, written by rank 0
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
