"""What a run shows and leaves: metrics.jsonl, the per-step line, a progress bar, sample groups
(completions.jsonl), and the TensorBoard / wandb sinks. plot.svg: ``align.run.plot``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.atomic import atomic_write_text
from align.options import flag

LINE_KEYS = ("reward_mean", "loss", "kl", "entropy", "completion_len_mean", "tokens_per_s", "step_time")


class MetricsLog:
    """Append-only ``metrics.jsonl``; on resume, records after the checkpoint's step are dropped."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        self.records: list[dict] = []
        self.sinks: list[Any] = []  # optional mirrors (``make_logger``); this file stays the source of truth
        self.said: set[str] = set()  # the warnings of align.run.advice already logged
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a crash mid-write
                if resume_step is not None and rec.get("step", 0) <= resume_step:
                    self.records.append(rec)
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))

    def write(self, record: dict) -> None:
        from align.run.advice import truncation_warning, warn_once

        warn_once("cut", truncation_warning(record), self.said)  # once: most completions cut at --max-tokens
        self.records.append(record)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def format_line(rec: dict) -> str:
    parts = [f"step {rec['step']}"]
    for k in LINE_KEYS:
        if k in rec:
            v = rec[k]
            parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    for k, v in rec.items():
        if k.startswith("eval/pass@1"):
            parts.append(f"{k} {v:.3f}")
    return " | ".join(parts)


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """A bar with ETA on a terminal; on a pipe, the step line carries the ETA instead."""

    def __init__(self, total: int, start: int = 0, stream=None):
        self.total, self.start_step = total, start
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()

    def eta(self, step: int) -> float:
        done = step - self.start_step
        return (time.monotonic() - self.t0) / done * (self.total - step) if done > 0 else float("nan")

    def update(self, step: int, line: str) -> None:
        eta = self.eta(step)
        eta_s = "?" if math.isnan(eta) else _fmt_time(eta)
        if self.tty:
            width = 30
            filled = int(width * step / max(1, self.total))
            self.stream.write("\r\033[K")
            print(line, flush=True)
            self.stream.write(f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} ETA {eta_s}")
            self.stream.flush()
        else:
            print(f"{line} | {step}/{self.total} ETA {eta_s}", flush=True)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


@dataclass
class LogConfig:
    log_completions_every: int = flag(
        10,
        "Every N steps append a few groups (prompt, completions, rewards, advantages, lengths) to {out}/completions.jsonl; 0 = off.",
    )
    log_completions_groups: int = flag(4, "Groups per --log-completions-every sample.")
    log_token_ids: bool = flag(
        False,
        "completions.jsonl also carries each completion's token ids, their text pieces and its mask (True = "
        "a policy token the loss trains on; False = an environment token), for python -m align.report.",
    )
    logger: str = flag(
        "none", "Also send metrics to 'wandb' or 'tensorboard' (optional packages); metrics.jsonl stays the record."
    )

    def __post_init__(self) -> None:
        if self.logger not in LOGGERS:
            raise ValueError(f"--logger must be one of {tuple(LOGGERS)}, got {self.logger!r}")
        if self.log_completions_every < 0 or self.log_completions_groups < 1:
            raise ValueError(
                "--log-completions-every must be >= 0 and --log-completions-groups >= 1, got "
                f"{self.log_completions_every}, {self.log_completions_groups}"
            )


def sample_groups(
    step: int,
    prompts: list[str],
    completions: list,
    texts: list[str],
    rewards: Any,
    advantages: Any,
    terms: dict[str, Any],
    n: int,
    decode: Any = None,
) -> list[dict]:
    """Records for ``completions.jsonl``: the first ``n`` groups of a step, one record per group, so a person can
    read what the model does. ``completions`` / ``texts`` align (``prompt_index`` indexes ``prompts``); ``rewards``,
    ``advantages`` and each ``terms`` value are (P, G) tensors; unscorable rewards are written as null. ``decode``
    (``--log-token-ids``: ids -> text) adds ``token_ids``, ``pieces`` (each token's text) and ``masks`` (True = a
    policy token, trained; False = an environment token, context only)."""

    def row(x: Any, p: int) -> list:
        return [None if isinstance(a, float) and math.isnan(a) else a for a in x[p].tolist()]

    groups: dict[int, list[int]] = {}
    for j, c in enumerate(completions):
        groups.setdefault(c.prompt_index, []).append(j)
    out = []
    for p in sorted(groups)[:n]:
        js = sorted(groups[p], key=lambda j: completions[j].sample_index)
        episodes = {}
        if hasattr(completions[js[0]], "turns"):  # multi-turn: each episode's conversation and turns
            episodes = {
                "episodes": [
                    {
                        "messages": completions[j].messages,
                        "turns": completions[j].turns,
                        "tool_calls": completions[j].tool_calls,
                        "tool_errors": completions[j].tool_errors,
                        "error": completions[j].error,
                    }
                    for j in js
                ]
            }
        out.append(
            {
                "step": step,
                "group": p,
                "prompt": prompts[p],
                "completions": [texts[j] for j in js],
                "rewards": row(rewards, p),
                "advantages": row(advantages, p),
                "lengths": [len(completions[j].token_ids) for j in js],
                "finish_reasons": [completions[j].finish_reason for j in js],
                "reward_terms": {k: row(v, p) for k, v in terms.items()},
                **episodes,
                **(_token_fields([completions[j] for j in js], decode) if decode else {}),
            }
        )
    return out


def _token_fields(completions: list, decode: Any) -> dict:
    ids = [list(c.token_ids) for c in completions]
    return {
        "token_ids": ids,
        "pieces": [token_pieces(row, decode) for row in ids],
        "masks": [list(c.mask) if getattr(c, "mask", None) else [True] * len(c.token_ids) for c in completions],
    }


def token_pieces(ids: list[int], decode: Any) -> list[str]:
    """Each token's text, decoded incrementally: a character split over byte tokens (byte-level BPE: 'é' is two) is
    shown whole on the token that completes it and "" on the ones before (decoding each token alone gives a
    U+FFFD per part). At most 3 tokens are held back (a UTF-8 character has at most 4 bytes)."""
    out: list[str] = []
    start = 0
    for i in range(len(ids)):
        text = decode(ids[start : i + 1])
        if text.endswith("\ufffd") and i + 1 < len(ids) and i - start < 3:
            out.append("")  # an incomplete character: the next token may complete it
            continue
        out.append(text)
        start = i + 1
    return out


class TensorBoardLogger:
    """Scalars of each metrics record at its ``step`` (``torch.utils.tensorboard``, needs ``tensorboard``)."""

    def __init__(self, log_dir: Path, resume_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                "--logger tensorboard needs the optional package 'tensorboard': pip install 'align[tensorboard]'"
            ) from None
        # purge_step drops events a killed run wrote after the checkpoint it resumes from
        self.writer = SummaryWriter(str(log_dir), purge_step=resume_step + 1 if resume_step else None)

    def log(self, record: dict) -> None:
        step = int(record.get("step", 0))
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Each metrics record to a wandb run keyed by the run dir (resumed with the same id); x-axis ``step``."""

    def __init__(self, out: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise ValueError("--logger wandb needs the optional package 'wandb': pip install 'align[wandb]'") from None
        id_file = out / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        atomic_write_text(id_file, run_id)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "align"),
            name=out.name,
            dir=str(out),
            id=run_id,
            resume="allow",
            config=config,
        )
        self.run.define_metric("*", step_metric="step")  # eval records arrive late for earlier steps

    def log(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if isinstance(v, (int, float))})

    def close(self) -> None:
        self.run.finish()


LOGGERS = {"none": None, "tensorboard": TensorBoardLogger, "wandb": WandbLogger}


def check_logger(kind: str, out: Path) -> None:
    """``--logger``'s package imports and its files can be written, checked before the model loads (``InputError``)."""
    import importlib

    from align.data import InputError

    if kind == "none":
        return
    module, extra = ("torch.utils.tensorboard", "tensorboard") if kind == "tensorboard" else ("wandb", "wandb")
    try:
        importlib.import_module(module)
    except ImportError:
        raise InputError(
            f"--logger {kind} needs the optional package {extra!r}: pip install 'align[{extra}]'"
        ) from None
    target = out / ("tensorboard" if kind == "tensorboard" else "wandb_id")
    if kind == "tensorboard" and (target.exists() or target.is_symlink()) and not target.is_dir():
        raise InputError(f"--logger tensorboard writes its events to {target}, which is a file: remove or rename it")
    if kind == "wandb" and target.is_dir():
        raise InputError(f"--logger wandb keeps the run id in {target}, which is a directory: remove or rename it")


def make_logger(kind: str, out: Path, config: dict, resume_step: int = 0) -> Any:
    """The optional metrics mirror for ``--logger`` (None for 'none'); its package is imported only here."""
    if kind == "tensorboard":
        return TensorBoardLogger(out / "tensorboard", resume_step)
    if kind == "wandb":
        return WandbLogger(out, config)
    return None
