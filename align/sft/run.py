"""Opening an SFT run: ``open_sft(cfg, ...) -> SFTRun``, built from a GRPO run's parts (``align.run.parts``'
``RunBase``, its ``Checkpointer``, ``write_config``, the ``Logs``; ``align.run.policy``'s ``load_policy``,
``open_optimizer``), so a supervised run has a GRPO
run's directory, safety checks, checkpoints, exact resume, torchrun sharding, LoRA and ``--save-hf``.

Order, as ``open_run``: the process group and placement; ``--out`` claimed (paths checked, locked); the tokenizer,
the rows rendered and checked and the reward loaded (bad input fails here, before the model loads); ``config.json``
(a resumed run refuses changed math); the policy (resumed, LoRA, sharded), optimizer and schedule; the run files;
the evaluator (blocking, in this process: eval/loss on the held-out rows, and with ``--reward`` sampled pass@k on
their prompts).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from align import dist, learner
from align.run import safety
from align.run.evaluation import eval_params
from align.run.log import Progress, check_logger
from align.run.parts import Logs, RunBase, write_config
from align.run.policy import DataCursor, load_policy, open_optimizer, stop_ids
from align.sft.config import SFTConfig
from align.sft.data import Example, Renderers, load_examples, read_model_config, verified_examples


class SFTRun(RunBase):
    """A ``Run`` whose steps are supervised batches of ``examples`` (the data cursor picks the rows)."""

    plot_title = "align SFT"
    examples: list[Example]
    eval_examples: list[Example]

    def checkpoint_state(self, step: int) -> dict:
        return {"cursor": dict(self.cursor.state)}

    def rows_for_step(self, step: int) -> list[int]:
        """Step ``step``'s rows (1-based): ``--batch-size`` of them (at most every training row once); with
        ``--steps 0`` the last step of the ``--epochs`` passes takes only what is left."""
        b = self.cfg.rows_per_step(len(self.examples))  # --batch-size, bounded by the data
        left = self.cfg.epochs * len(self.examples) - (step - 1) * b
        return self.cursor.next_prompts(min(b, left) if self.exact_epochs else b)


def tensors(examples: list[Example], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded teacher-forcing rows: inputs (N, L), targets (N, L), mask (N, L) True at target tokens."""
    L = max((len(e.ids) for e in examples), default=2) - 1
    inputs = [e.ids[:-1] + [0] * (L - len(e.ids) + 1) for e in examples]
    targets = [e.ids[1:] + [0] * (L - len(e.ids) + 1) for e in examples]
    mask = [e.mask[1:] + [False] * (L - len(e.ids) + 1) for e in examples]
    as_long = {"dtype": torch.long, "device": device}
    return (
        torch.tensor(inputs, **as_long).view(-1, L),
        torch.tensor(targets, **as_long).view(-1, L),
        torch.tensor(mask, dtype=torch.bool, device=device).view(-1, L),
    )


def mine(examples: list[Example]) -> list[Example]:
    """This rank's contiguous share of ``examples`` (all of them in one process)."""
    return examples[slice(*dist.share(len(examples)))]


def open_sft(
    cfg: SFTConfig,
    *,
    model: str | None,
    tokenizer: Any,
    rows: list | None,
    eval_rows: list | None,
    reward: Any,
    stop_flag: dict | None,
) -> SFTRun:
    """Build an ``SFTRun`` (see the module docstring); on a failure after parts started, they are closed."""
    from align.device import resolve as resolve_placement

    run = SFTRun(cfg, {} if stop_flag is None else stop_flag)
    run.owns_group = dist.setup(cfg)
    run.place = resolve_placement(cfg.device, cfg.precision)
    try:
        _open_data(run, model, tokenizer, rows, eval_rows, reward)
        _open_policy(run)
        run.use_logs(Logs.open(run.cfg, run.out, run.step, run.resumed))
        _open_eval(run)
        if dist.is_main():
            run.progress = Progress(run.cfg.steps, start=run.step)
    except BaseException as e:
        run.close(after_error=e)
        raise
    return run


def _open_data(
    run: SFTRun, model: str | None, tokenizer: Any, rows: list | None, eval_rows: list | None, reward: Any
) -> None:
    """--out claimed, the rows rendered and checked, the reward loaded, ``cfg.steps`` resolved, config.json."""
    from align.data import InputError, load_tokenizer
    from align.hub import resolve_model, resolve_tokenizer
    from align.rewards import make_scorer

    cfg = run.cfg
    cfg.model, model = resolve_model(cfg.model), resolve_model(model, "model=")  # a hub id: its cached snapshot
    cfg.data.tokenizer = resolve_tokenizer(cfg.data.tokenizer)
    run.model_path = model or cfg.model
    if run.model_path is None:
        raise InputError("--model DIR is required: the Hugging Face checkpoint directory to fine-tune")
    d = cfg.data
    if rows is None and not d.train_data and not d.from_verified:
        raise InputError("no training rows: pass --train-data FILE.jsonl or --from-verified GEN.jsonl VERIF.jsonl")
    run.run_id, run.out_lock = safety.open_out(cfg, run.model_path)
    check_logger(cfg.log.logger, run.out)
    config = read_model_config(run.model_path)
    if tokenizer is None:
        src = d.tokenizer or run.model_path
        tokenizer = load_tokenizer(src, run.model_path, "--tokenizer" if d.tokenizer else "--model")
    renderers = Renderers(tokenizer)
    if d.from_verified and rows is None:
        run.examples = verified_examples(d.from_verified, d.per_problem_k, config)
    else:
        run.examples = load_examples(d.train_data, rows, "--train-data", renderers, d.train_on, config)
    run.eval_examples = []
    if eval_rows is not None or d.eval_data:
        run.eval_examples = load_examples(d.eval_data, eval_rows, "--eval-data", renderers, d.train_on, config)
    longest = max(len(e.ids) - 1 for e in run.examples + run.eval_examples)
    if cfg.micro_batch_tokens and longest > cfg.micro_batch_tokens:
        raise InputError(
            f"--micro-batch-tokens {cfg.micro_batch_tokens} is smaller than the longest row ({longest} "
            f"tokens); raise it to >= {longest}"
        )
    has_reward = reward is not None or bool(cfg.rewards.reward)
    run.scorer = run.pass_reward = None
    if has_reward and not run.eval_examples:
        raise InputError("--reward scores the eval's samples (pass@k): pass --eval-data FILE.jsonl too, or drop it")
    if has_reward:
        from align.eval.metrics import pass_reward_for

        budget = cfg.eval.eval_max_tokens or cfg.max_tokens
        context = config.get("max_position_embeddings")
        for e in run.eval_examples:
            if isinstance(context, int) and e.prompt + budget > context:
                raise InputError(
                    f"{e.where}: the prompt is {e.prompt} tokens; with --max-tokens {budget} the eval's "
                    f"samples do not fit the model's context of {context}; lower --max-tokens"
                )

        run.scorer = make_scorer(cfg.rewards, reward, [e.record for e in run.eval_examples])
        run.pass_reward = pass_reward_for(run.scorer.names, cfg.eval.eval_pass_reward)
    run.tokenizer, run.stops = tokenizer, stop_ids(tokenizer, _Eos(config))
    run.exact_epochs = cfg.steps == 0
    if cfg.batch_size > len(run.examples):
        print(f"[align] --batch-size {cfg.batch_size}: a step takes the {len(run.examples)} training rows", flush=True)
    run.cfg = cfg = replace(cfg, steps=cfg.total_steps(len(run.examples)))  # the schedule and --save-hf need it
    write_config(cfg, run.out, run.model_path)


class _Eos:
    """The model config's ``eos_token_id`` (config.json), for ``stop_ids`` before the model loads."""

    def __init__(self, config: dict) -> None:
        self.eos_token_id = config.get("eos_token_id")


def _open_policy(run: SFTRun) -> None:
    """Policy (resumed, LoRA, sharded), optimizer, schedule, data cursor and the non-finite step count."""
    cfg, place = run.cfg, run.place
    policy, resume, state = load_policy(cfg, place, run.model_path, run.out)
    policy = dist.shard(policy, place.precision)
    run.opt, run.sched = open_optimizer(cfg, policy, place, resume, state)
    cursor = None
    if resume:
        run.step, cursor = state["step"], state["cursor"]
        print(f"[align] resuming from {resume[1]} (step {run.step})", flush=True)
    run.cursor = DataCursor(len(run.examples), cfg.seed, cursor)
    run.nonfinite = learner.NonFiniteSteps(cfg.max_nonfinite_steps, (state or {}).get("nonfinite_steps", 0))
    run.policy, run.mcfg, run.resumed = policy, policy.config, bool(resume)
    if not resume:
        torch.manual_seed(cfg.seed)


def _open_eval(run: SFTRun) -> None:
    """The blocking evaluator: eval/loss (mean token NLL of the held-out rows' targets); with a reward, eval/pass@k
    of ``--eval-n`` samples per held-out prompt (the context before its last target)."""
    from align.eval.evaluator import Evaluator

    cfg = run.cfg
    eval_cfg = cfg.eval if run.eval_examples else replace(cfg.eval, eval_interval=0)
    run.eval_cfg = eval_cfg
    run.evaluator = Evaluator(eval_cfg, blocking_eval_fn=lambda step: evaluate(run))


def evaluate(run: SFTRun) -> dict:
    """One eval point of the live policy (every rank: its share of the rows, the sums all-reduced)."""
    from align.eval.metrics import score_completions, scored
    from align.rollout.client import ShardedNativeClient
    from align.rollout.native import generate

    cfg, policy = run.cfg, run.policy
    policy.eval()
    with torch.no_grad():
        stats = learner.nll_backward(
            policy, cfg, *tensors(mine(run.eval_examples), run.place.device), place=run.place, backward=False
        )
    out = {"loss": stats["loss"], "tokens": stats["num_tokens"]}
    if run.scorer is None:
        return out
    sampling = eval_params(cfg, run.stops)
    prompts = [e.ids[: e.prompt] for e in run.eval_examples]
    with run.place.autocast():
        if dist.active():  # every rank samples its share (the same completions), all score them
            comps = ShardedNativeClient(policy).generate(prompts, sampling)
        else:
            comps = generate(policy, prompts, sampling)

    def score(i: int, ids: list[int]) -> Any:
        text = run.tokenizer.decode(ids[:-1] if ids and ids[-1] in run.stops else ids)
        return scored(*run.scorer.score([(run.eval_examples[i].record, text)]).item(0), run.pass_reward)

    return {**out, **score_completions(prompts, comps, score, sampling.n)}


def finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)
