"""``SFTConfig``: every setting of a supervised fine-tuning run, the single source of the ``python -m align.sft`` flags.

The settings a GRPO run has too are the same dataclasses: ``OptimConfig`` (optimizer, schedule), ``ComputeConfig``
(device and precision, micro-batching, torchrun) and ``SaveConfig`` (top-p / top-k, checkpoints, ``--save-hf``) as
bases, their fields flat, and the nested sections (``LoraConfig``, ``EvalConfig``, ``RewardConfig``, ``LogConfig``), so
a flag means the same in both commands and no default or name exists twice; ``shared`` copies a ``TrainConfig`` field
whose help differs here (rows, not completions). What is SFT's own: the data (``SFTDataConfig``:
row files, ``--train-on``, ``--from-verified``), ``--epochs`` and ``--batch-size``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from align.data import DataConfig
from align.eval.config import EvalConfig
from align.lora import LoraConfig
from align.options import flag  # the one definition of a flag's help
from align.options import flag_help as _h
from align.rewards import RewardConfig
from align.run.cli import read_sections
from align.run.config import ComputeConfig, OptimConfig, SaveConfig, TrainConfig
from align.run.log import LogConfig

TRAIN_ON = ("all", "last")


def shared(cls: type, name: str, **metadata: Any) -> Any:
    """A new field with the default (or default factory) and help of ``cls``'s field ``name``: one definition for
    the settings two configs share; ``metadata`` (e.g. ``help=``) replaces what differs."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    kw = {"default": f.default} if f.default is not dataclasses.MISSING else {"default_factory": f.default_factory}
    return field(**kw, metadata={**f.metadata, **metadata})


@dataclass
class SFTDataConfig:
    train_data: str | None = flag(
        None,
        "SFT rows: a .jsonl or .parquet file, each row 'messages' (a chat; its assistant turns are the targets) "
        "or 'prompt' + 'completion' (a string prompt or a chat list, and the assistant's text).",
    )
    eval_data: str | None = flag(
        None, "Held-out rows, same format: eval/loss; with --reward also sampled pass@k on their prompts."
    )
    tokenizer: str | None = shared(DataConfig, "tokenizer")
    train_on: str = flag(
        "all", "Which assistant turns of a 'messages' row are targets: 'all', or 'last' (earlier ones are context)."
    )
    from_verified: list[str] = field(
        default_factory=list,
        metadata=_h(
            "Expert iteration: train on the verified samples of pipeline_gen_verify results, GEN.jsonl VERIF.jsonl "
            "pairs (several rounds: more pairs); the recorded prompt ids and sampled completion ids, never "
            "re-tokenized. Replaces --train-data."
        ),
    )
    per_problem_k: int = flag(
        4, "With --from-verified: at most this many verified samples per problem, distinct proofs (0 = all)."
    )

    def __post_init__(self) -> None:
        if self.train_on not in TRAIN_ON:
            raise ValueError(f"--train-on must be one of {TRAIN_ON}, got {self.train_on!r}")
        if len(self.from_verified) % 2:
            raise ValueError(
                f"--from-verified takes GEN.jsonl VERIF.jsonl pairs, got {len(self.from_verified)} path(s): "
                f"{self.from_verified}; pass each generation file followed by its verification file"
            )
        if self.from_verified and self.train_data:
            raise ValueError("--from-verified and --train-data both name the training rows; pass one of them")
        if self.per_problem_k < 0:
            raise ValueError(f"--per-problem-k must be >= 0 (0 = every verified sample), got {self.per_problem_k}")


@dataclass
class SFTConfig(SaveConfig, ComputeConfig, OptimConfig):
    """Every setting of an SFT run; the sections it shares with ``TrainConfig`` are the same dataclasses (the
    optimizer, compute and save settings as bases, flat; ``lora``, ``eval``, ``rewards``, ``log`` nested)."""

    out: str = flag("runs/sft", "Run directory: config, metrics, checkpoints, plot.")
    model: str | None = flag(None, "HF checkpoint dir to fine-tune (Llama/Qwen2/Qwen3).")
    seed: int = flag(0, "Seed for the data order (a shuffle per epoch), eval sampling, LoRA init.")
    epochs: int = flag(1, "Passes over the training rows (each one in its own shuffled order).")
    batch_size: int = flag(32, "Rows per optimizer step, at most the training rows (the last step takes what is left).")
    steps: int = flag(0, "Optimizer steps; 0 = --epochs passes over the rows (ceil(epochs * rows / batch)).")
    lr: float = flag(1e-4, "Peak AdamW learning rate.")
    micro_batch_size: int = shared(
        TrainConfig, "micro_batch_size", help="Rows per forward/backward; never changes the result."
    )
    pack_sequences: bool = shared(
        TrainConfig,
        "pack_sequences",
        help="Forwards on packed rows: the rows end to end, "
        "each attending only to itself (rows with the same context before their first "
        "target share one copy of it), no padding (the same loss and gradients); "
        "--no-pack-sequences pads every row to its micro-batch's longest.",
    )
    max_tokens: int = flag(10, "Max new tokens per eval completion (pass@k with --reward).")
    temperature: float = flag(1.0, "Eval sampling temperature (--eval-temperature wins).")
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(eval_interval=10, eval_n=4))
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        read_sections(self)  # each section given as a dict (a --config file's) becomes its dataclass
        for k in ("epochs", "batch_size", "micro_batch_size", "max_tokens", "max_nonfinite_steps"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(self, k)}")
        for k in (
            "steps",
            "warmup_steps",
            "checkpoint_every",
            "keep_checkpoints",
            "threads",
            "top_k",
            "micro_batch_tokens",
        ):
            if getattr(self, k) < 0:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 0, got {getattr(self, k)}")
        for k in ("lr", "temperature", "dist_timeout_s"):
            if not (math.isfinite(getattr(self, k)) and getattr(self, k) > 0):
                raise ValueError(f"--{k.replace('_', '-')} must be a finite number > 0, got {getattr(self, k)}")
        choices = {
            "lr_schedule": ("constant", "linear", "cosine"),
            "logprob_backend": ("auto", "torch", "triton", "reference"),
        }
        for k, allowed in choices.items():
            if getattr(self, k) not in allowed:
                raise ValueError(f"--{k.replace('_', '-')} must be one of {allowed}, got {getattr(self, k)!r}")
        if not (0 < self.top_p <= 1) or not (0 <= self.min_lr_ratio <= 1):
            raise ValueError(
                f"--top-p must be in (0, 1] and --min-lr-ratio in [0, 1], got {self.top_p}, {self.min_lr_ratio}"
            )
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"--adam-betas {self.adam_betas} is invalid: need two values in [0, 1), e.g. 0.9 0.99")
        if self.eval.uses_snapshots:
            raise ValueError(
                "align.sft evaluates in process: --eval-num-gpus and --eval-function-path are "
                "align.train's snapshot eval; drop them"
            )
        self.eval.check_save_hf(self.save_hf)
        if self.merge_lora and not self.lora.enabled:
            raise ValueError("--merge-lora needs --lora-rank > 0 (it merges the adapter into the --save-hf export)")

    def rows_per_step(self, rows: int) -> int:
        """Rows per optimizer step: ``batch_size``, bounded by the ``rows`` training rows (a step never holds a row
        twice, so its memory and time are bounded by the data whatever ``--batch-size`` says)."""
        return max(1, min(self.batch_size, rows))

    def total_steps(self, rows: int) -> int:
        """The run's optimizer steps for ``rows`` training rows: ``steps``, else ``epochs`` passes over them."""
        return self.steps or math.ceil(self.epochs * rows / self.rows_per_step(rows))


CLI_PREFIXES = {"lora": "lora-"}  # the data, eval, reward and log fields are flat, as in align.train
