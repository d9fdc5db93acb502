"""What a run learns: ``Task`` (prompt rows, tokenizer, reward, held-out rows, optionally an environment class),
from your data and rewards or a built-in task (``--task reverse`` / ``multiturn``) with its warm-started model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align import dist
from align.data import InputError
from align.run.config import TrainConfig
from align.run.sources import apply_task_defaults


@dataclass
class Task:
    """What to learn: prompt dicts, a tokenizer, a reward, held-out prompts."""

    prompts: list[dict]
    tokenizer: Any
    reward: Callable[..., float | None]
    eval_prompts: list[dict] = field(default_factory=list)
    encoded: tuple[list, list] | None = None  # (prompt ids, eval ids) when align.data already tokenized them
    env: type | None = None  # an environment class (align.envs): each row is G episodes; reward is optional
    env_spec: str | None = None  # how an --env-workers process loads it


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


def builtin_task(cfg: TrainConfig) -> tuple[Task, str]:
    """The built-in task (``align.tasks.TASKS``) and its warm-started model dir (built once, under {out}/base_model)."""
    from align.atomic import is_committed
    from align.tasks import load_task

    mod = load_task(cfg.task)
    apply_task_defaults(cfg, mod.TRAIN_DEFAULTS)
    task = Task(
        mod.prompts(5000, "train", cfg.seed),
        mod.tokenizer(),
        mod.reward,
        mod.prompts(cfg.eval_prompts, "eval", cfg.seed),
        env=mod.Env,
        env_spec=f"{mod.__name__}:Env" if mod.Env else None,
    )
    # before the warm start
    mod.check_sizes(task.prompts + task.eval_prompts, task.tokenizer, cfg.max_tokens, cfg.envs.max_turns)
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
        import torch

        from align.device import resolve_threads

        torch.set_num_threads(resolve_threads(cfg.threads))  # --threads holds for the warm start too
        print(
            f"[align] warm start: {cfg.warm_start_steps} supervised steps of the {cfg.task!r} task's biased "
            f"mixture -> {base}",
            flush=True,
        )
        mod.warm_start(base, steps=cfg.warm_start_steps, seed=cfg.seed, log=lambda s: print(f"[align] {s}", flush=True))
    return task, str(base)


def env_task(cfg: TrainConfig, given: Given) -> tuple[Task, str]:
    """A multi-turn task: rows from ``--train-data`` / ``prompts`` (every column goes to the environment), the
    environment class from ``--env`` (a name of ``align.tasks.ENVIRONMENTS`` or ``file.py:Class``) / ``env=`` (or the
    tool environment from ``--tools`` / ``tools=``), the tokenizer of the model (or ``--tokenizer``), rewards optional
    (they score the final assistant message and add)."""
    from align.data import load_tokenizer, read_rows, with_template_kwargs
    from align.envs.runner import load_env_class
    from align.envs.sampler import check_env

    e, env, tools = cfg.envs, given.env, given.tools
    tokenizer, prompts, eval_prompts = given.tokenizer, given.prompts, given.eval_prompts
    model_path = given.model or cfg.model
    if prompts is None and not cfg.data.train_data:
        raise InputError(
            "--env needs --train-data FILE.jsonl (its rows are the episodes' arguments) and --model DIR; "
            "the built-in multi-turn task is --task multiturn (without --env)"
        )
    if model_path is None:
        raise InputError("--env needs --model DIR (a Hugging Face checkpoint directory)")
    spec = None
    if env is None and (tools or e.tools):  # the tool environment over --tools / tools=[fn], built (checked) now
        from align.envs.tools import tool_env

        env = tool_env(e, tools)
    elif env is None:  # a name of align.tasks.ENVIRONMENTS or file.py:Class
        from align.tasks import env_spec

        spec = env_spec(e.env or "agent")  # --agent alone picks the agent row
        env = load_env_class(spec, "--env")
    located = None  # (file:line, row) of each row read here, for the errors of the environment's check_rows
    if prompts is None:
        located = read_rows(cfg.data.train_data)
        prompts = [row for _, row in located]
        if cfg.data.eval_data:
            evals = read_rows(cfg.data.eval_data, "--eval-data")
            located, eval_prompts = located + evals, [row for _, row in evals]
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.data.tokenizer or model_path, model_path)
    with_template_kwargs(tokenizer, cfg.data.chat_template_kwargs)
    rows = [dict(r) for r in prompts]
    if not rows:
        raise InputError("no rows to train on (--train-data is empty)")
    if spec is None and not tools and not e.tools:
        from align.rewards import spec_of

        spec = spec_of(env)
    if e.env_workers and spec is None:
        raise InputError(
            "--env-workers >= 1 loads the environment class in worker processes by its spec; an env= "
            "class passed from Python has none: pass --env path/file.py:Class, or use --env-workers 0"
        )
    check_env(  # the environment's check_rows hook, before the model loads
        env,
        cfg,
        located
        or [(f"prompts[{i}]", r) for i, r in enumerate(rows)]
        + [(f"eval_prompts[{i}]", r) for i, r in enumerate(eval_prompts or [])],
    )
    task = Task(rows, tokenizer, given.reward, [dict(r) for r in eval_prompts or []], env=env, env_spec=spec)
    return task, model_path


def as_records(prompts: list, tokenizer: Any = None, prompt_key: str = "prompt") -> list[dict]:
    """The Python API's prompts as records: a str, a dict with a 'prompt' str, or a chat row (``messages`` or a chat
    list under ``prompt_key``) rendered with the tokenizer's chat template, as the CLI reads ``--train-data``."""
    from align.data import to_record

    out = []
    for i, p in enumerate(prompts):
        rec = {"prompt": p} if isinstance(p, str) else dict(p) if isinstance(p, dict) else p
        if isinstance(rec, dict) and not isinstance(rec.get("prompt"), str):  # a chat row
            rec = to_record(rec, f"prompts[{i}]", prompt_key, getattr(tokenizer, "chat_template", None))
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise ValueError(f"prompt {i} must be a str or a dict with a 'prompt' str, got {type(p).__name__}")  # noqa: TRY004
        out.append(rec)
    if not out:
        raise ValueError("no prompts to train on")
    return out


def resolve_task(cfg: TrainConfig, given: Given | None = None) -> tuple[Task, str]:
    """``find_task``, then ``--epochs`` turned into ``--steps`` from the task's rows and ``--lr`` checked against
    the model's size (``align.run.advice``)."""
    from align.run.advice import check_lr

    task, model_path = find_task(cfg, given or Given())
    apply_epochs(cfg, len(task.prompts))
    check_lr(cfg, model_path, set())  # a user's large checkpoint at a toy lr: said once, before the model loads
    return task, model_path


def find_task(cfg: TrainConfig, given: Given) -> tuple[Task, str]:
    """The task (your data from ``--train-data`` / the arguments, or the built-in one) and its model dir."""
    if given.env is not None or given.tools or cfg.envs.enabled:
        return env_task(cfg, given)
    model, reward = given.model, given.reward
    tokenizer, prompts, eval_prompts = given.tokenizer, given.prompts, given.eval_prompts
    ids = None  # the prompts' ids when align.data tokenized them (each row once)
    if prompts is None and cfg.data.train_data:  # your own data from files (align.data); rewards from --reward
        if not (model or cfg.model):
            raise InputError("--train-data needs --model DIR (a Hugging Face checkpoint directory)")
        from align.data import load_task_data

        tokenizer, prompts, eval_prompts, *ids = load_task_data(cfg.data, model or cfg.model, cfg.max_tokens)
    has_reward = reward is not None or bool(cfg.rewards.reward) or (cfg.distill.distill_only and prompts is not None)
    if (prompts is None) == has_reward or (prompts is not None and tokenizer is None):
        raise InputError(
            "pass prompts, tokenizer and reward together (CLI: --train-data and --reward), or none of "
            "them for the built-in task"
        )
    if prompts is None:
        return dist.main_first(lambda: builtin_task(cfg))
    key = cfg.data.prompt_key
    if prompts is not None and cfg.data.chat_template_kwargs and not cfg.data.train_data:  # the Python API's rows
        from align.data import with_template_kwargs

        with_template_kwargs(tokenizer, cfg.data.chat_template_kwargs)
    evals = as_records(eval_prompts, tokenizer, key) if eval_prompts else []
    task = Task(as_records(prompts, tokenizer, key), tokenizer, reward, evals, ids and tuple(ids))
    model_path = model or cfg.model
    if model_path is None:
        raise ValueError("no model: pass model=<HF checkpoint dir> or --model")
    return task, model_path


def apply_epochs(cfg: TrainConfig, n_prompts: int) -> None:
    """``--epochs E``: ``cfg.steps`` = ceil(E * prompts / ``--prompts-per-step``), said once (TRL counts epochs)."""
    if cfg.epochs > 0:
        import math

        steps = max(1, math.ceil(cfg.epochs * n_prompts / cfg.prompts_per_step))
        print(
            f"[align] --epochs {cfg.epochs:g}: {n_prompts} prompts / --prompts-per-step {cfg.prompts_per_step} "
            f"-> --steps {steps}" + (f" (was {cfg.steps})" if cfg.steps != steps else ""),
            flush=True,
        )
        cfg.steps = steps
