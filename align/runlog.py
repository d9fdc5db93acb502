"""What a run shows and leaves: metrics.jsonl, the per-step line, a progress bar, and plot.svg.

The plot is a hand-written SVG (no plotting package in the core dependencies): a grid of panels on one shared
step axis (reward and every eval metric at the step its snapshot was taken; loss and KL; entropy; completion
length; truncation; tokens/s), each with its own y range and a legend beside the data.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from align.atomic import atomic_write_text

LINE_KEYS = ("reward_mean", "loss", "kl", "entropy", "completion_len_mean", "tokens_per_s", "step_time")


class MetricsLog:
    """Append-only ``metrics.jsonl``; on resume, records after the checkpoint's step are dropped."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        self.records: list[dict] = []
        self.sinks: list[Any] = []  # optional mirrors (``make_logger``); this file stays the source of truth
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


# The panels of plot.svg: (id, title, metric keys or key prefixes ending in "*"). Every panel shares the step axis.
PANELS = (
    ("reward", "reward and eval", ("reward_mean", "eval/pass@*", "eval/avg@*")),
    ("loss", "loss and KL", ("loss", "kl")),
    ("entropy", "entropy", ("entropy",)),
    ("length", "completion length (tokens)", ("completion_len_mean",)),
    ("truncation", "truncated fraction", ("truncated_frac",)),
    ("throughput", "tokens/s (rollout)", ("tokens_per_s",)),
)
# Series styles: colour, dash pattern, marker and a stroke width that shrinks with the index, so a curve drawn
# exactly on top of an earlier one (eval/avg@4 == eval/pass@1) leaves the earlier one's edges and markers visible.
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
DASHES = ("", "7 4", "2 3", "10 3 2 3")
MARKERS = ("circle", "square", "triangle", "diamond")
PANEL_W, PANEL_H, COLS = 620, 250, 2
PLOT_LEFT, PLOT_W, PLOT_TOP, PLOT_H = 62, 300, 32, 170  # the data area inside a panel; the legend sits to its right
LEGEND_LEFT = PLOT_LEFT + PLOT_W + 16
TITLE_H = 36


def _match(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key.startswith(p[:-1]) if p.endswith("*") else key == p for p in patterns)


def _series(records: list[dict], patterns: tuple[str, ...]) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        for k, v in r.items():
            if _match(k, patterns) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out.setdefault(k, []).append((float(r["step"]), float(v)))
    order = {p: i for i, p in enumerate(patterns)}  # panel order, then name: reward_mean, pass@1, pass@4, avg@4 ...
    return dict(sorted(out.items(), key=lambda kv: (next(order[p] for p in patterns if _match(kv[0], (p,))), kv[0])))


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Evenly spaced ticks at round steps (1, 2, 2.5, 5 x 10^k) covering [lo, hi], about n of them."""
    raw = (hi - lo) / (n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first, last = math.floor(lo / step), math.ceil(hi / step)
    return [k * step for k in range(first, last + 1)]


def _fmt_tick(v: float) -> str:
    return f"{v:.6g}" if v != 0 else "0"  # a round step prints short; 0 stays 0, never 1e-17


def _marker(kind: str, x: float, y: float, color: str) -> str:
    r = 3.2
    if kind == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{color}"/>'
    if kind == "square":
        return f'<rect x="{x - r:.1f}" y="{y - r:.1f}" width="{2 * r}" height="{2 * r}" fill="none" stroke="{color}"/>'
    if kind == "triangle":
        pts = f"{x:.1f},{y - r - 1:.1f} {x - r - 1:.1f},{y + r:.1f} {x + r + 1:.1f},{y + r:.1f}"
        return f'<polygon points="{pts}" fill="none" stroke="{color}"/>'
    pts = f"{x:.1f},{y - r - 1:.1f} {x + r + 1:.1f},{y:.1f} {x:.1f},{y + r + 1:.1f} {x - r - 1:.1f},{y:.1f}"
    return f'<polygon points="{pts}" fill="{color}" fill-opacity="0.5" stroke="{color}"/>'


def _panel(pid: str, title: str, series: dict, ox: float, oy: float, x0: float, x1: float) -> list[str]:
    """One panel at (ox, oy): title, framed data area with its own y range and ticks, legend to the right."""
    out = [
        f'<g id="panel-{pid}" class="panel" transform="translate({ox},{oy})">',
        f'<text class="panel-title" x="{PLOT_LEFT}" y="18" font-size="13" font-weight="bold">{escape(title)}</text>',
        f'<rect x="{PLOT_LEFT}" y="{PLOT_TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="none" stroke="#999"/>',
    ]
    values = [v for pts in series.values() for _, v in pts]
    if not values:
        out.append(f'<text x="{LEGEND_LEFT}" y="{PLOT_TOP + 14}" fill="#999">no data</text></g>')  # legend place
        return out
    lo, hi = min(values), max(values)
    if hi == lo:
        lo, hi = lo - max(abs(lo) * 0.1, 0.5), hi + max(abs(hi) * 0.1, 0.5)
    yticks = _ticks(lo, hi)
    lo, hi = yticks[0], yticks[-1]  # the axis ends on round ticks around the data

    def X(s: float) -> float:
        return PLOT_LEFT + (s - x0) / (x1 - x0) * PLOT_W

    def Y(v: float) -> float:
        return PLOT_TOP + PLOT_H - (v - lo) / (hi - lo) * PLOT_H

    for v in yticks:
        y = Y(v)
        out.append(f'<line x1="{PLOT_LEFT}" y1="{y:.1f}" x2="{PLOT_LEFT + PLOT_W}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{PLOT_LEFT - 5}" y="{y + 4:.1f}" text-anchor="end">{_fmt_tick(v)}</text>')
    for s in (t for t in _ticks(x0, x1) if x0 <= t <= x1):
        out.append(f'<text x="{X(s):.1f}" y="{PLOT_TOP + PLOT_H + 15}" text-anchor="middle">{_fmt_tick(s)}</text>')
    out.append(f'<text x="{PLOT_LEFT + PLOT_W / 2}" y="{PLOT_TOP + PLOT_H + 31}" text-anchor="middle">step</text>')
    legend = []
    for j, (name, pts) in enumerate(series.items()):
        color, dash, marker = COLORS[j % len(COLORS)], DASHES[j % len(DASHES)], MARKERS[j % len(MARKERS)]
        width = max(1.2, 3.6 - 0.8 * j)
        pts = sorted(pts)
        points = " ".join(f"{X(s):.1f},{Y(v):.1f}" for s, v in pts)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<g class="series" data-name="{escape(name)}">')
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="{width}"{dash_attr} points="{points}"/>')
        out.extend(_marker(marker, X(s), Y(v), color) for s, v in pts)
        out.append("</g>")
        ly = PLOT_TOP + 10 + 18 * j
        line = f'x1="{LEGEND_LEFT}" y1="{ly}" x2="{LEGEND_LEFT + 22}" y2="{ly}"'
        legend.append(f'<line {line} stroke="{color}" stroke-width="{width}"{dash_attr}/>')
        legend.append(_marker(marker, LEGEND_LEFT + 11, ly, color))
        label = f"{escape(name)} (last {pts[-1][1]:.4g})"
        legend.append(f'<text x="{LEGEND_LEFT + 28}" y="{ly + 4}" fill="{color}">{label}</text>')
    out.append('<g class="legend">')
    out.extend(legend)
    out.append("</g></g>")
    return out


def write_plot(path: Path, records: list[dict], title: str = "align run") -> None:
    """plot.svg: one panel per ``PANELS`` entry (reward and every eval/pass@* and eval/avg@* metric; loss and
    KL; entropy; completion length; truncated fraction; tokens/s), 2 columns on one shared step axis, each
    panel with its own y range and its legend (with the last value) beside, never over, the data. Hand-written
    SVG: no plotting package in the core dependencies."""
    panels = [(pid, name, _series(records, keys)) for pid, name, keys in PANELS]
    steps = [s for _, _, series in panels for pts in series.values() for s, _ in pts] or [0.0, 1.0]
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    rows = -(-len(panels) // COLS)
    W, H = COLS * PANEL_W, TITLE_H + rows * PANEL_H
    head = f'width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11"'
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" {head}>',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="24" text-anchor="middle" font-size="15">{escape(title)}</text>',
    ]
    for i, (pid, name, series) in enumerate(panels):
        out += _panel(pid, name, series, (i % COLS) * PANEL_W, TITLE_H + (i // COLS) * PANEL_H, x0, x1)
    out.append("</svg>")
    atomic_write_text(path, "\n".join(out) + "\n")


# ------------------------------------------------------------------------------------------------ sample logs, loggers


@dataclass
class LogConfig:
    log_completions_every: int = field(
        default=10,
        metadata={
            "help": "Every N steps append a few groups (prompt, completions, rewards, advantages, lengths) to {out}/completions.jsonl; 0 = off."
        },
    )
    log_completions_groups: int = field(default=4, metadata={"help": "Groups per --log-completions-every sample."})
    logger: str = field(
        default="none",
        metadata={
            "help": "Also send metrics to 'wandb' or 'tensorboard' (optional packages); metrics.jsonl stays the record."
        },
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
) -> list[dict]:
    """Records for ``completions.jsonl``: the first ``n`` groups of a step, one record per group, so a person can
    read what the model does. ``completions`` / ``texts`` align (``prompt_index`` indexes ``prompts``); ``rewards``,
    ``advantages`` and each ``terms`` value are (P, G) tensors; unscorable rewards are written as null."""

    def row(x: Any, p: int) -> list:
        return [None if isinstance(a, float) and math.isnan(a) else a for a in x[p].tolist()]

    groups: dict[int, list[int]] = {}
    for j, c in enumerate(completions):
        groups.setdefault(c.prompt_index, []).append(j)
    out = []
    for p in sorted(groups)[:n]:
        js = sorted(groups[p], key=lambda j: completions[j].sample_index)
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
            }
        )
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


def make_logger(kind: str, out: Path, config: dict, resume_step: int = 0) -> Any:
    """The optional metrics mirror for ``--logger`` (None for 'none'); its package is imported only here."""
    if kind == "tensorboard":
        return TensorBoardLogger(out / "tensorboard", resume_step)
    if kind == "wandb":
        return WandbLogger(out, config)
    return None
