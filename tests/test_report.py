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


def test_a_character_split_over_byte_tokens_shows_whole_on_the_token_that_completes_it():
    """Byte-level BPE trained on ASCII splits 'é' (2 bytes) and '😀' (4) into byte tokens: decoded one by one each part
    is U+FFFD (the negative control: what the report showed before); incrementally, the character lands whole on its
    last byte's token, the others show "", and every piece joined is the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(["ab cd"] * 4, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))
    ids = tok.encode("aé b😀").ids
    decode = tok.decode
    assert [decode([t]) for t in ids].count("\ufffd") == 6  # é: 2 bytes, 😀: 4
    from align.run.log import token_pieces

    pieces = token_pieces(ids, decode)
    assert "".join(pieces) == "aé b😀" and "\ufffd" not in "".join(pieces) and len(pieces) == len(ids)
    assert pieces[pieces.index("é") - 1] == "" and pieces[-4:] == ["", "", "", "😀"]
    cut = token_pieces(ids[:-1], decode)  # a character cut at the end: shown as it decodes, on the last token
    assert cut[-1] == "\ufffd" and cut[:-3] == pieces[:-4]


def test_the_config_shows_what_was_set_and_folds_the_defaults(tmp_path):
    from align.report import config_table

    (tmp_path / "config.json").write_text(json.dumps({"lr": 1e-6, "steps": 3, "seed": 0}))
    (tmp_path / "config_sources.json").write_text(json.dumps({"lr": "default", "steps": "flag", "seed": "default"}))
    page = config_table(tmp_path)
    shown, folded = page.split("<details>")
    assert "steps" in shown and "lr" not in shown and "2 settings at their defaults" in folded and "lr" in folded


def test_an_empty_completion_is_said_and_the_curves_scale_to_the_page(tmp_path):
    from align.report import render

    rec = {"step": 1, "group": 0, "prompt": "p", "completions": ["", "ab"], "pieces": [[""], ["a", "b"]]}
    rec.update(token_ids=[[0], [1, 2]], masks=[[True], [True, True]])
    (tmp_path / "completions.jsonl").write_text(json.dumps(rec) + "\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    page = render(tmp_path)
    assert page.count("(empty completion)") == 1  # the stop-only one; "ab" (the control) is not
    assert "svg{max-width:100%;height:auto}" in page and 'viewBox="0 0 ' in page  # scales: a narrow window cut it
