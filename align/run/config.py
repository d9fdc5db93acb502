"""``TrainConfig``: every setting of a GRPO run, the single source of the ``python -m align.train`` flags.

The defaults are for a user's checkpoint (0.5B-8B, as TRL's and verl's GRPO recipes: lr 1e-6, 256 completion tokens,
G 8, DAPO's token-mean loss with clip-higher 0.28 and no KL); a built-in task (``--task``) carries its own settings
(``TRAIN_DEFAULTS``), applied only when it runs, below ``--config`` and flags (``align.run.sources``).

Validation happens in ``__post_init__`` (values, choices, cross-field rules) so a bad setting fails before
anything loads; ``align.cli`` checks the types of ``--config`` JSON from these annotations.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from align.advantages import AdvantageConfig
from align.data import DataConfig
from align.envs.config import EnvConfig
from align.eval.config import EvalConfig
from align.grpo import LossConfig
from align.lean.config import LeanConfig
from align.lean.corrections import CorrectionConfig
from align.lora import LoraConfig
from align.moe import MoeConfig
from align.options import flag  # the one definition of a flag's help
from align.options import flag_help as _h
from align.rewards import RewardConfig
from align.rollout.backends import RolloutConfig
from align.run.cli import read_sections
from align.run.log import LogConfig
from align.run.presets import PRESET_NAMES
from align.run.teacher import DistillConfig
from align.run.watchdog import WatchdogConfig


@dataclass
class OptimConfig:
    """The optimizer, its schedule and the non-finite guard: the settings ``align.train`` and ``align.sft`` share."""

    warmup_steps: int = flag(3, "Linear LR warm-up steps.")
    lr_schedule: str = flag("constant", "After warm-up: 'constant', 'linear' or 'cosine' decay to min_lr_ratio.")
    min_lr_ratio: float = flag(0.1, "Final LR as a fraction of lr for linear/cosine.")
    weight_decay: float = flag(0.0, "AdamW weight decay.")
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.99], metadata=_h("AdamW betas."))
    grad_clip: float = flag(1.0, "Max global grad norm (0 = off).")
    max_nonfinite_steps: int = flag(
        3,
        "Optimizer steps with a NaN/inf loss or gradient norm are skipped (no weight changes) and counted "
        "(nonfinite_steps); the run stops with an error once this many were skipped.",
    )


@dataclass
class ComputeConfig:
    """Where and how the model computes (device, precision, micro-batches, torchrun): shared with ``align.sft``."""

    micro_batch_size: int = flag(64, "Completions per forward/backward; never changes the result.")
    micro_batch_tokens: int = flag(
        0,
        "Token budget per forward/backward (rows sorted by length, padding counted); replaces --micro-batch-size when > 0; never changes the result.",
    )
    pack_sequences: bool = flag(
        True,
        "Learner forwards on packed rows: each group's prompt once, its completions after it, no padding (the same gradients); --no-pack-sequences pads every completion to its micro-batch's longest row.",
    )
    device: str = flag("auto", "Training device: auto (CUDA when available), cpu, cuda or cuda:N.")
    precision: str = flag(
        "auto",
        "fp32, bf16-mixed (fp32 master weights, bf16 autocast) or bf16 (bf16 weights, fp32 AdamW moments); auto = bf16-mixed on CUDA, fp32 on CPU.",
    )
    gradient_checkpointing: bool = flag(False, "Recompute layer activations in backward.")
    dist_timeout_s: float = flag(
        600.0, "Under torchrun: seconds a collective waits for the other ranks before failing."
    )
    dp_replicate: int = flag(1, "Under torchrun: HSDP replica groups (the world is dp_replicate x dp_shard ranks).")
    dp_shard: int = flag(0, "Under torchrun: ranks each replica shards over (0: world size / dp_replicate).")
    threads: int = flag(
        0,
        "torch CPU threads; 0 = auto: OMP_NUM_THREADS when set, else the CPUs this process may use (split between torchrun's local ranks). With --max-async-steps >= 1 on a CPU the native sampler's generation thread runs on half of them (at least 1) and the trainer on the rest.",
    )
    logprob_backend: str = flag(
        "auto", "Token logprob kernel: auto (triton on CUDA, chunked torch elsewhere), torch, triton, reference."
    )


@dataclass
class SaveConfig:
    """Nucleus / top-k sampling, checkpoints and the ``--save-hf`` export: shared with ``align.sft``."""

    top_p: float = flag(1.0, "Nucleus sampling mass.")
    top_k: int = flag(0, "Top-k sampling (0 = off).")
    checkpoint_every: int = flag(20, "Checkpoint every N steps (and at the end); 0 = only at the end.")
    keep_checkpoints: int = flag(2, "Keep the last K checkpoints.")
    save_hf: str | None = flag(
        None,
        "Also export the final model as an HF dir here (replaced by atomic rename; refuses a non-empty dir that is not an export of this run; LoRA: the PEFT adapter dir).",
    )
    overwrite: bool = flag(False, "Let --save-hf replace a non-empty dir that is not an earlier export of this run.")
    resume_from: str | None = flag(
        None, "Resume from this committed checkpoint ('step_N') instead of the latest; later ones are moved aside."
    )
    merge_lora: bool = flag(False, "With LoRA, --save-hf writes a merged full HF checkpoint instead of the adapter.")


@dataclass
class TrainConfig(RolloutConfig, SaveConfig, ComputeConfig, OptimConfig, WatchdogConfig):
    """Every setting of a run; the rollout section (``--rollout``, ``--spool``, ...) is ``RolloutConfig``'s, flat."""

    out: str = flag("runs/reverse", "Run directory: config, metrics, checkpoints, plot.")
    model: str | None = flag(
        None, "HF checkpoint dir (Llama/Qwen2/Qwen3). None: the built-in task's warm-started model."
    )
    task: str = flag("reverse", "Built-in task used when no prompts/reward are passed ('reverse').")
    seed: int = flag(0, "Seed for data order, sampling and init.")
    steps: int = flag(100, "Optimizer steps.")
    epochs: float = flag(
        0.0,
        "Passes over the training prompts (TRL num_train_epochs); sets --steps to ceil(epochs x prompts / "
        "--prompts-per-step) once the data is read. 0 = use --steps.",
    )
    prompts_per_step: int = flag(32, "Prompts per step (each sampled group_size times).")
    group_size: int = flag(8, "Completions per prompt (G).")
    max_tokens: int = flag(256, "Max new tokens per completion (TRL's default).")
    min_p: float = flag(0.0, "Min-p sampling: drop tokens below min_p x the top one's (0 = off).")
    repetition_penalty: float = flag(
        1.0, "vLLM's repetition penalty on tokens already seen (1 = off; > 1 discourages)."
    )
    temperature: float = flag(1.0, "Sampling temperature (also the training logprob basis).")
    behaviour_logprobs: str = flag(
        "sampled",
        "Sampler logprob used as mu for rho: 'sampled' (the truncated distribution actually sampled from) or 'full' (full-vocabulary).",
    )
    lr: float = flag(1e-6, "Peak AdamW learning rate (full fine-tuning of a 0.5B-8B model; LoRA: ~1e-5).")
    updates_per_batch: int = flag(
        1, "Passes over each batch (PPO epochs, TRL num_iterations); old logprobs are computed once before the first."
    )
    mini_batches: int = flag(1, "Optimizer steps per pass: the batch is split into this many mini-batches.")
    dtype: str | None = flag(None, "Deprecated alias of --precision: float32 = fp32, bfloat16 = bf16.")
    eval_prompts: int = flag(200, "Held-out prompts of the built-in task for eval.")
    warm_start_steps: int = flag(800, "Supervised warm-start steps of the built-in task's model.")
    preset: str = flag(
        "none",
        f"Loss + advantage options of one algorithm: {', '.join(PRESET_NAMES)}; explicit flags / --config keys win. Applied by the CLI; in Python use align.run.presets.build.",
    )
    adv_refill: bool = flag(
        False,
        "DAPO dynamic sampling: sample more prompts until --prompts-per-step groups have non-zero reward variance (at most --max-refill-rounds extra rounds).",
    )
    max_refill_rounds: int = flag(4, "Max extra sampling rounds per step with --adv-refill.")
    data: DataConfig = field(default_factory=DataConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    log: LogConfig = field(default_factory=LogConfig)
    loss: LossConfig = field(default_factory=lambda: LossConfig(eps_high=0.28))  # DAPO's clip-higher, no KL
    adv: AdvantageConfig = field(default_factory=AdvantageConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(eval_interval=10, eval_n=4))
    lora: LoraConfig = field(default_factory=LoraConfig)
    envs: EnvConfig = field(default_factory=EnvConfig)
    lean: LeanConfig = field(default_factory=LeanConfig)  # --env lean: the verifier (--lean-repl, ...)
    lean_corrections: CorrectionConfig = field(default_factory=CorrectionConfig)  # --lean-correction-fraction, ...
    distill: DistillConfig = field(default_factory=DistillConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)  # --routing-replay, --router-aux-loss-coef, --freeze-router

    @staticmethod
    def default_layers(data: dict) -> list[tuple[str, dict[str, Any]]]:
        """The built-in task's ``TRAIN_DEFAULTS`` when ``data`` (``asdict`` shape) runs it, then the rollout backend's
        (``align.run.sources``): ``[("task", {...}), ("backend", {...})]``."""
        from align.run.sources import default_layers

        return default_layers(data)

    def __post_init__(self) -> None:
        read_sections(self)  # each section given as a dict (a --config file's) becomes its dataclass
        positive = (
            "steps",
            "prompts_per_step",
            "group_size",
            "max_tokens",
            "micro_batch_size",
            "updates_per_batch",
            "mini_batches",
            "max_nonfinite_steps",
        )
        for k in positive:
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(self, k)}")
        choices = {
            "lr_schedule": ("constant", "linear", "cosine"),
            "behaviour_logprobs": ("sampled", "full"),
            "logprob_backend": ("auto", "torch", "triton", "reference"),
            "preset": PRESET_NAMES,
        }
        self.check_rollout()  # its section's values; the backend is a row of BACKENDS (align.rollout.backends)
        for k, allowed in choices.items():
            if getattr(self, k) not in allowed:
                raise ValueError(f"--{k.replace('_', '-')} must be one of {allowed}, got {getattr(self, k)!r}")
        if self.lr <= 0 or self.temperature <= 0:
            raise ValueError(f"--lr and --temperature must be > 0 for training, got {self.lr}, {self.temperature}")
        check_train_values(self)
        self.envs.check(self.max_tokens)
        from align.rollout.pipeline import check_config as check_async

        check_async(self.max_async_steps, self.max_inflight_requests, self.group_size)
        if self.max_async_steps and self.sync_every != 1:
            raise ValueError(
                f"--max-async-steps {self.max_async_steps} publishes the weights after every step; "
                f"--sync-every {self.sync_every} does not apply: drop it (or use --max-async-steps 0)"
            )
        self.eval.check_save_hf(self.save_hf)
        if self.distill.distill_only and self.adv_refill:
            raise ValueError("--adv-refill samples until groups differ in reward; --distill-only computes no reward")
        if self.merge_lora and not self.lora.enabled:
            raise ValueError("--merge-lora needs --lora-rank > 0 (it merges the adapter into the --save-hf export)")
        if self.colocate and self.rollout_sleep_level == 2 and self.lora.enabled:
            raise ValueError("--rollout-sleep-level 2 drops the base weights a LoRA worker keeps: use level 1")
        from align.learner import check_config

        check_config(self)
        self.check_watchdog()  # --stall-timeout-s against the per-call timeouts (align.run.watchdog)


CLI_PREFIXES = {
    "adv": "adv-",
    "lora": "lora-",
    "lean": "lean-",
}  # loss fields are flat (--eps-low, --kl-coef, --loss NAME); eval fields are eval_*


MAX_STEP_TOKENS = 2**28
"""Cap on the tokens one step may sample, ``prompts_per_step * group_size * max_tokens`` (the prompts come on top).
Every sampled token costs ~100 bytes of host memory whatever the model (an int64 id and two float32 logprobs in the
native sampler's buffers, then an int object and two float objects with their list slots in each ``Completion``:
72 bytes measured for the ids and one logprob list), so 2**28 tokens already hold ~25 GiB before the model's KV
cache. A larger product is a typo (``--group-size 3000000``) that would otherwise fail only after the model loads, as
a multi-GB allocation; the largest published GRPO steps fit (DAPO: 512 prompts x 16 x 20k tokens = 1.7e8)."""


def check_train_values(cfg: object) -> None:
    """Values of a ``TrainConfig`` that would only fail (or silently do nothing) after the warm start.

    Called from ``TrainConfig.__post_init__``; each message names the flag, the value and the valid range."""

    def bad(flag: str, value: object, need: str) -> ValueError:
        return ValueError(f"--{flag} {value!r} is invalid: {need}")

    for key in ("lr", "temperature", "rollout_timeout_s", "dist_timeout_s"):
        v = getattr(cfg, key)
        if not (math.isfinite(v) and v > 0):
            raise bad(key.replace("_", "-"), v, "must be a finite number > 0")
    if not (0 < cfg.top_p <= 1):
        raise bad("top-p", cfg.top_p, "the nucleus mass must be in (0, 1] (1 = off)")
    if not (0 <= cfg.min_lr_ratio <= 1):
        raise bad("min-lr-ratio", cfg.min_lr_ratio, "must be in [0, 1]")
    for key in ("weight_decay", "grad_clip", "epochs"):
        v = getattr(cfg, key)
        if not (math.isfinite(v) and v >= 0):
            raise bad(key.replace("_", "-"), v, "must be a finite number >= 0 (0 = off)")
    if len(cfg.adam_betas) != 2 or not all(0 <= b < 1 for b in cfg.adam_betas):
        raise bad("adam-betas", cfg.adam_betas, "need two values in [0, 1), e.g. 0.9 0.99")
    for key in (
        "top_k",
        "warmup_steps",
        "checkpoint_every",
        "keep_checkpoints",
        "threads",
        "eval_prompts",
        "warm_start_steps",
    ):
        if getattr(cfg, key) < 0:
            raise bad(key.replace("_", "-"), getattr(cfg, key), "must be >= 0")
    if cfg.group_size < 2:
        raise bad(
            "group-size",
            cfg.group_size,
            "a group of one completion has zero variance, so every group-relative advantage is exactly 0 and the "
            f"run cannot learn; no advantage baseline here ({', '.join(_baselines())}) makes it meaningful: 'mean' "
            "subtracts the completion's own reward and 'rloo' has no other completion to leave out. Use >= 2",
        )
    step_tokens = cfg.prompts_per_step * cfg.group_size * cfg.max_tokens
    if step_tokens > MAX_STEP_TOKENS:
        raise bad(
            "group-size" if cfg.group_size >= cfg.prompts_per_step else "prompts-per-step",
            max(cfg.group_size, cfg.prompts_per_step),
            f"one step samples --prompts-per-step {cfg.prompts_per_step} x --group-size {cfg.group_size} = "
            f"{cfg.prompts_per_step * cfg.group_size:,} completions of up to --max-tokens {cfg.max_tokens} tokens "
            f"= {step_tokens:,} tokens, over the cap of {MAX_STEP_TOKENS:,} (2**28) tokens per step (the sampler's "
            f"buffers and the completions' token and logprob lists alone would need ~{step_tokens * 100 / 2**30:,.0f} "
            "GiB of host memory before any KV cache): lower --group-size, --prompts-per-step or --max-tokens",
        )
    if cfg.adv.overlong_buffer > cfg.max_tokens:
        raise bad("adv-overlong-buffer", cfg.adv.overlong_buffer, f"must be <= --max-tokens {cfg.max_tokens}")
    if cfg.eval_prompts == 0 and cfg.eval.eval_interval > 0:
        raise bad(
            "eval-prompts",
            0,
            f"--eval-interval {cfg.eval.eval_interval} needs held-out prompts of the built-in "
            "task (or --eval-interval 0 for no eval)",
        )
    if cfg.resume_from is not None and not re.fullmatch(r"step_\d+", cfg.resume_from):
        raise bad("resume-from", cfg.resume_from, "name a committed checkpoint dir, 'step_N'")
    if cfg.eval.eval_temperature is not None and not math.isfinite(cfg.eval.eval_temperature):
        raise bad("eval-temperature", cfg.eval.eval_temperature, "must be finite (0 = greedy)")
    if not cfg.eval.eval_timeout_s > 0:
        raise bad("eval-timeout-s", cfg.eval.eval_timeout_s, "must be > 0")


def _baselines() -> tuple[str, ...]:
    from align.advantages import BASELINES

    return BASELINES


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """The learning-rate multiplier per scheduler step: linear warmup, then constant / linear / cosine to min_lr_ratio."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        decay = 1 - frac if cfg.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return f
