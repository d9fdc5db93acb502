"""``--config FILE``: TOML / YAML / JSON, flat flag names (kebab or snake) or sections, flags win, one-line errors
naming file, key and line; a run's config.json loads back through the same path."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from align.run.presets import parse
from align.train import CLI_PREFIXES, TrainConfig

OLD_CONFIG = Path(__file__).parent / "data" / "compat_0.1.0" / "config.json"

TOML = """\
group-size = 4
max_tokens = 32
lr = 1e-6
adam-betas = [0.9, 0.95]

[loss]
eps_high = 0.28

[adv]
scale = "none"

[sampling]
top-p = 0.9
"""

YAML = """\
group-size: 4
max_tokens: 32
lr: 1.0e-6
adam-betas: [0.9, 0.95]
loss:
  eps_high: 0.28
adv:
  scale: none
sampling:
  top-p: 0.9
"""


def load(tmp_path: Path, name: str, text: str, *flags: str) -> TrainConfig:
    path = tmp_path / name
    path.write_text(text)
    return parse(TrainConfig, ["--config", str(path), *flags], CLI_PREFIXES, log=lambda *_: None)


def error_of(tmp_path: Path, name: str, text: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        load(tmp_path, name, text)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(("name", "text"), [("run.toml", TOML), ("run.yaml", YAML), ("run.yml", YAML)])
def test_a_file_sets_flat_and_sectioned_keys(tmp_path, name, text):
    pytest.importorskip("yaml") if name.endswith(("yaml", "yml")) else None
    cfg = load(tmp_path, name, text)
    default = parse(TrainConfig, [], CLI_PREFIXES, log=lambda *_: None)  # no file: the built-in task's values
    got = (cfg.group_size, cfg.max_tokens, cfg.lr, cfg.adam_betas, cfg.loss.eps_high, cfg.adv.scale, cfg.top_p)
    assert got == (4, 32, 1e-6, [0.9, 0.95], 0.28, "none", 0.9)
    # negative control: each differs from the run without the file, so the file really set it
    assert all(
        a != b
        for a, b in zip(
            got,
            (
                default.group_size,
                default.max_tokens,
                default.lr,
                default.adam_betas,
                default.loss.eps_high,
                default.adv.scale,
                default.top_p,
            ),
        )
    )


def test_flags_override_the_file(tmp_path):
    cfg = load(tmp_path, "run.toml", TOML, "--group-size", "6", "--eps-high", "0.2")
    assert (cfg.group_size, cfg.loss.eps_high, cfg.max_tokens) == (6, 0.2, 32)


def test_a_saved_config_json_loads_back(tmp_path):
    cfg = TrainConfig(group_size=4, max_tokens=17, lr=3e-6, top_k=5)
    cfg.loss.eps_high = 0.3
    saved = {**asdict(cfg), "model": None}  # as write_config saves it
    back = load(tmp_path, "config.json", json.dumps(saved))
    assert asdict(back) == asdict(cfg)
    assert asdict(load(tmp_path, "x.json", json.dumps({**saved, "top_k": 6}))) != asdict(cfg)  # negative control


def test_the_0_1_config_json_loads_through_the_same_path(tmp_path):
    cfg = load(tmp_path, "config.json", OLD_CONFIG.read_text())
    old = json.loads(OLD_CONFIG.read_text())
    assert cfg.lr == old["lr"] and cfg.loss.eps_high == old["loss"]["eps_high"]


def test_unknown_key_names_the_nearest_key_file_and_line(tmp_path, capsys):
    err = error_of(tmp_path, "run.toml", "steps = 3\n\ngroup-sise = 4\n", capsys)
    assert "run.toml:3" in err and "'group-sise'" in err and "'group-size'" in err
    err = error_of(tmp_path, "run.toml", "[loss]\neps_hihg = 0.3\n", capsys)
    assert "run.toml:2" in err and "[loss]" in err and "'eps-high'" in err


def test_wrong_type_names_the_key(tmp_path, capsys):
    err = error_of(tmp_path, "run.toml", "steps = 3\nmax-tokens = 1.5\n", capsys)
    assert "run.toml:2" in err and "'max-tokens'" in err and "must be int" in err
    err = error_of(tmp_path, "run.yaml", "pack-sequences: maybe\n", capsys)
    assert "'pack-sequences'" in err and "bool" in err


def test_toml_syntax_error_names_the_line(tmp_path, capsys):
    err = error_of(tmp_path, "run.toml", "steps = 3\nlr = \n", capsys)
    assert "run.toml" in err and "line 2" in err


def test_yaml_without_pyyaml_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML absent: import yaml raises ImportError
    err = error_of(tmp_path, "run.yaml", YAML, capsys)
    assert "PyYAML" in err and "align[yaml]" in err


def test_an_unknown_suffix_is_refused(tmp_path, capsys):
    err = error_of(tmp_path, "run.ini", "steps = 3\n", capsys)
    assert ".toml" in err and ".yaml" in err


def test_the_docs_toml_example_parses(tmp_path):
    import re

    text = (Path(__file__).parents[1] / "docs" / "overview.md").read_text()
    block = re.search(r"```toml\n(.*?)```", text, flags=re.DOTALL).group(1)
    cfg = load(tmp_path, "run.toml", block)
    assert (cfg.group_size, cfg.max_tokens, cfg.loss.eps_high, cfg.data.train_data) == (
        8,
        256,
        0.28,
        "examples/own_data/train.jsonl",
    )


def test_a_yaml_alias_bomb_is_a_short_error(tmp_path, capsys):
    pytest.importorskip("yaml")
    inner = '["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]'  # a 500-byte file ...
    for i in range(6):  # ... whose value is 10^7 strings: each level is 10 references to the one below
        inner = f"[&a{i} {inner}, " + ", ".join([f"*a{i}"] * 9) + "]"
    text = f"tools: [{inner}]\n"
    assert len(text) < 600
    err = error_of(tmp_path, "bomb.yaml", text, capsys)
    assert "'tools[0]' must be str" in err and len(err) < 2000  # was its full repr: 5 MB here, 50 MB at 10^8
    err = error_of(tmp_path, "small.yaml", "tools: [[x, y]]\n", capsys)
    assert "['x', 'y']" in err  # control: a small value is shown whole


@pytest.mark.parametrize(
    ("name", "twice", "once", "said"),
    [
        ("run.json", '{"lr": 0.001,\n "lr": 0.002}', '{"lr": 0.002}', "run.json: key 'lr' is set twice"),
        ("run.yaml", "lr: 0.001\nsteps: 3\nlr: 0.002\n", "steps: 3\nlr: 0.002\n", "run.yaml:3: key 'lr' is set twice"),
        ("run.yaml", "loss:\n  lr: 0.2\n  lr: 0.3\n", "loss:\n  lr: 0.3\n", "run.yaml:3: key 'lr' is set twice"),
        (
            "run.toml",
            "lr = 0.001\nlr = 0.002\n",
            "lr = 0.002\n",
            "Cannot overwrite a value (at line 2",
        ),  # tomllib's words
    ],
)
def test_a_key_set_twice_is_refused_not_last_wins(tmp_path, capsys, name, twice, once, said):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    assert said in error_of(tmp_path, name, twice, capsys)
    if "loss" not in once:  # control: the key once loads
        assert load(tmp_path, name, once).lr == 0.002
