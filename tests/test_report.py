"""``python -m align.report RUN_DIR``: the report of a tiny real run, parsed back with html.parser."""

from __future__ import annotations

import json
import os
import stat
from html.parser import HTMLParser

from helpers_train import PROMPTS, TOK, a_reward, cfg_for

from align.report import main, tokens_html
from align.train import train


class Outline(HTMLParser):
    """Tags, ids, token spans and text of a page, and whether anything would load from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.ids: set[str] = set()
        self.spans: dict[str, int] = {}
        self.external: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        self.tags.append(tag)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "span" and a.get("class") in ("t", "m"):
            self.spans[a["class"]] = self.spans.get(a["class"], 0) + 1
        if tag in ("script", "link", "img") or any(k in ("src", "href") for k in a):
            self.external.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def outline(path) -> Outline:
    o = Outline()
    o.feed(path.read_text(encoding="utf-8"))
    return o


def shared_modes(run) -> set[int]:
    return {stat.S_IMODE((run / f).stat().st_mode) for f in ("config.json", "config_sources.json", "plot.svg")}


def with_umask(mask: int, fn):
    old = os.umask(mask)
    try:
        return fn()
    finally:
        os.umask(old)


def test_report_of_a_real_run(tmp_path, char_model):
    run = tmp_path / "run"
    cfg = cfg_for(run, steps=2, checkpoint_every=0)
    cfg.log.log_completions_every, cfg.log.log_token_ids = 1, True
    with_umask(0o022, lambda: train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward))
    assert shared_modes(run) == {0o644}  # files for others follow the umask (mkstemp alone gives 0600)
    sample = json.loads((run / "completions.jsonl").read_text().splitlines()[0])
    assert len(sample["token_ids"][0]) == sample["lengths"][0] == len(sample["masks"][0]) == len(sample["pieces"][0])
    assert with_umask(0o022, lambda: main([str(run)])) == 0
    assert stat.S_IMODE((run / "report.html").stat().st_mode) == 0o644
    o = outline(run / "report.html")
    assert {"curves", "config", "samples"} <= o.ids and "svg" in o.tags and "polyline" in o.tags
    assert o.spans.get("t", 0) == sum(len(ids) for r in _rows(run) for ids in r["token_ids"])
    assert "m" not in o.spans and not o.external  # single-turn: every token trained; nothing loads from elsewhere
    text = "".join(o.text)
    assert "lr" in text and "code" in text and sample["prompt"] in text


def test_run_without_completions_still_renders(tmp_path, char_model):
    run = tmp_path / "run"
    cfg = cfg_for(run, steps=1, checkpoint_every=0)
    cfg.log.log_completions_every = 0  # the control: no completions.jsonl
    with_umask(0o077, lambda: train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward))
    assert shared_modes(run) == {0o600}  # the control: a private umask keeps them private
    assert not (run / "completions.jsonl").exists()
    assert main([str(run), "--output", str(tmp_path / "r.html")]) == 0
    o = outline(tmp_path / "r.html")
    assert "svg" in o.tags and "no completions.jsonl samples" in "".join(o.text) and not o.spans


def test_tokens_show_trained_and_masked():
    page = tokens_html(["ab", "<tool>", "c"], [1, 2, 3], [True, False, True])
    o = Outline()
    o.feed(page)
    assert o.spans == {"t": 2, "m": 1} and "".join(o.text) == "ab<tool>c"


def _rows(run):
    return [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]


def test_a_hostile_run_dir_renders_no_markup(tmp_path):
    """Every value a run dir's files carry is text in the report: step / group, token ids in an attribute, metric
    names in the SVG's attributes (each was raw HTML before)."""
    from align.report import render

    x = '"><script>alert(1)</script>'
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval/pass@1" + x: 1.0}) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({x: x}))
    rec = {"step": x, "group": x, "prompt": x, "completions": [x], "pieces": [[x]], "token_ids": [[x]], "masks": [[1]]}
    (tmp_path / "completions.jsonl").write_text(json.dumps(rec) + "\n")
    page = render(tmp_path)
    tags = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            tags.append((tag, [k for k, _ in attrs]))

    Tags().feed(page)
    assert not [t for t in tags if t[0] == "script"]
    assert not [t for t in tags if any(k.startswith("on") or not k.isidentifier() and "-" not in k for k in t[1])]
    assert page.count("&lt;script&gt;") >= 4  # control: the text is there, escaped
