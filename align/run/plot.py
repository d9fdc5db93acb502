"""plot.svg: a hand-written SVG of a run's metrics (no plotting package in the core dependencies).

A grid of panels on one shared step axis (reward and every eval metric at the step its snapshot was taken; loss
and KL; entropy; completion length; truncation; tokens/s), each with its own y range and a legend beside the data.
"""

from __future__ import annotations

import math
from pathlib import Path
from xml.sax.saxutils import escape

from align.atomic import atomic_write_text

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
        out.append(f'<g class="series" data-name="{escape(name, {chr(34): "&quot;"})}">')  # in an attribute
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
    """plot.svg (``plot_svg``)."""
    atomic_write_text(path, plot_svg(records, title), shared=True)  # for people: the umask's mode


def plot_svg(records: list[dict], title: str = "align run") -> str:
    """The SVG text: one panel per ``PANELS`` entry (reward and every eval/pass@* and eval/avg@* metric; loss and
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
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------ sample logs, loggers
