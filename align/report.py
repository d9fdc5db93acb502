"""``python -m align.report RUN_DIR``: one self-contained ``report.html`` of a run (stdlib only, inline SVG and CSS).

Three sections, each from a file the run wrote:

- the metric curves (``metrics.jsonl``, drawn by ``align.run.plot.plot_svg``, the same panels as ``plot.svg``);
- the config (``config.json``) with where each value came from (``config_sources.json``: default, task, backend, resume, file,
  preset, flag; ``align.run.sources``), the values that are not defaults first;
- sampled groups (``completions.jsonl``): prompt, each completion with its reward, advantage and finish reason; an
  episode's messages by role; with ``--log-token-ids`` every token as a span, trained (a policy token) or masked (an
  environment token, context only), its id in the tooltip.

A run dir without one of these files renders the others and says what is missing. No JavaScript, no network.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path
from typing import Any

CSS = """
body{font-family:sans-serif;margin:24px;max-width:1300px;color:#222}svg{max-width:100%;height:auto}
h1{font-size:20px}h2{font-size:17px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px;text-align:left}
tr.changed td{background:#fff8e0}.src{color:#666}
.group{border:1px solid #ddd;border-radius:4px;margin:10px 0;padding:8px}
.prompt,.completion{white-space:pre-wrap;font-family:monospace;font-size:12px;margin:4px 0}
.completion{border-left:3px solid #9ecae1;padding-left:6px}.meta{color:#555;font-size:11px}
.t{background:#dff0d8}.m{background:#eee;color:#888}.role{font-weight:bold;font-size:11px;color:#444}
.missing{color:#a33}summary{cursor:pointer;font-size:12px;color:#555;margin:6px 0}
"""
MAX_GROUPS = 8  # the last this many sampled groups


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash: the rest still renders
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and prefix + k != "data.chat_template_kwargs":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def curves(records: list[dict], title: str) -> str:
    from align.run.plot import plot_svg

    if not any("step" in r for r in records):
        return '<p class="missing">no metrics.jsonl records</p>'
    svg = plot_svg(records, title)
    return svg[svg.index("<svg") :]  # inline: no XML declaration


def config_table(run: Path) -> str:
    path = run / "config.json"
    if not path.is_file():
        return '<p class="missing">no config.json</p>'
    values = _flat(json.loads(path.read_text(encoding="utf-8")))
    src_path = run / "config_sources.json"
    sources = json.loads(src_path.read_text(encoding="utf-8")) if src_path.is_file() else {}
    said, defaults = [], []  # the values something set, shown; the ~200 defaults folded below them
    for k in sorted(values):
        src = sources.get(k, "default" if sources else "")
        cls = ' class="changed"' if src not in ("default", "") else ""
        value = html.escape(json.dumps(values[k]))
        row = f'<tr{cls}><td>{html.escape(k)}</td><td>{value}</td><td class="src">{html.escape(src)}</td></tr>'
        (defaults if src == "default" else said).append(row)
    head = "<table><tr><th>setting</th><th>value</th><th>from</th></tr>"
    out = head + "".join(said) + "</table>" if said else ""
    if defaults:
        out += f"<details><summary>{len(defaults)} settings at their defaults</summary>{head}{''.join(defaults)}</table></details>"
    return out


def tokens_html(pieces: list[str], ids: list[int], mask: list[bool]) -> str:
    """Each token as a span: class ``t`` (trained: a policy token) or ``m`` (masked: an environment token)."""
    spans = []
    for piece, tid, trained in zip(pieces, ids, mask):
        kind, what = ("t", "trained") if trained else ("m", "masked")
        spans.append(
            f'<span class="{kind}" title="id {html.escape(str(tid))}: {what}">{html.escape(str(piece))}</span>'
        )
    return "".join(spans)


def group_html(rec: dict) -> str:
    where = f"step {rec.get('step')} | group {rec.get('group')}"  # a hostile completions.jsonl: text, escaped
    out = [
        f'<div class="group"><div class="meta">{html.escape(where)}</div>',
        f'<div class="prompt">{html.escape(_text(rec.get("prompt", "")))}</div>',
    ]
    texts = rec.get("completions") or []
    episodes = rec.get("episodes") or []
    for j, text in enumerate(texts):
        meta = " | ".join(
            f"{name} {_at(rec.get(key), j)}"
            for name, key in (("reward", "rewards"), ("advantage", "advantages"), ("finish", "finish_reasons"))
        )
        terms = rec.get("reward_terms") or {}
        meta += "".join(f" | {html.escape(k)} {_at(v, j)}" for k, v in terms.items())
        if j < len(episodes) and episodes[j].get("turns"):
            meta += f" | turns {len(episodes[j]['turns'])}"
        if rec.get("pieces") and j < len(rec["pieces"]):
            body = tokens_html(rec["pieces"][j], rec["token_ids"][j], rec["masks"][j])
        elif j < len(episodes) and episodes[j].get("messages"):
            body = "".join(
                f'<div class="role">{html.escape(str(m.get("role")))}</div>{html.escape(_text(m.get("content")))}'
                for m in episodes[j]["messages"]
            )
        else:
            body = html.escape(_text(text))
        if text == "":  # a completion that stopped at once (its stop token decodes to nothing): said, not a blank box
            body += '<span class="missing">(empty completion)</span>'
        out.append(f'<div class="meta">{html.escape(meta)}</div><div class="completion">{body}</div>')
    out.append("</div>")
    return "".join(out)


def _at(values: Any, j: int) -> str:
    if not isinstance(values, list) or j >= len(values):
        return "-"
    v = values[j]
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _text(x: Any) -> str:
    return x if isinstance(x, str) else json.dumps(x, ensure_ascii=False, indent=1)


def render(run: Path) -> str:
    """The report's HTML text for the run dir ``run``."""
    title = f"align run: {run.name}"
    samples = _rows(run / "completions.jsonl")[-MAX_GROUPS:]
    body = "".join(group_html(r) for r in samples) or '<p class="missing">no completions.jsonl samples</p>'
    legend = (
        '<p class="meta">tokens: <span class="t key">trained (policy)</span> <span class="m key">masked (environment)</span></p>'
        if any(r.get("pieces") for r in samples)
        else ""
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        f'<h2 id="curves">Metrics</h2>{curves(_rows(run / "metrics.jsonl"), title)}'
        f'<h2 id="config">Config</h2>{config_table(run)}'
        f'<h2 id="samples">Samples</h2>{legend}{body}</body></html>\n'
    )


def main(argv: list[str] | None = None) -> int:
    from align.atomic import atomic_write_text

    p = argparse.ArgumentParser(prog="python -m align.report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="A run directory (--out of python -m align.train / align.sft).")
    p.add_argument("--output", default=None, help="Where to write the report (default RUN_DIR/report.html).")
    a = p.parse_args(argv)
    run = Path(a.run_dir)
    if not run.is_dir():
        p.error(f"{run}: not a directory (pass a run's --out dir)")
    out = Path(a.output) if a.output else run / "report.html"
    atomic_write_text(out, render(run), shared=True)
    print(f"[align] report: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
