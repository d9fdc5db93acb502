"""What the 0.2.0 renovation promised to keep: every CLI flag of 0.1.0 and the ``config.json`` of a 0.1.0 run.

``tests/data/compat_0.1.0/`` holds what 0.1.0 (commit 631c426) produced: ``train_flags.txt``, the flags
``python -m align.train --help`` listed, and ``config.json``, the default ``TrainConfig`` a run wrote (``model``
null). Data, not numbers: the tests read them back through today's parser."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from align.run.cli import from_dict
from align.train import TrainConfig

OLD = Path(__file__).parent / "data" / "compat_0.1.0"
FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def help_flags() -> set[str]:
    # --help-all is 0.1.0's --help (every flag with its help; --help is now the grouped names); 0.1.0's list came
    # from that text, so it carries two wrapped-help fragments ('--ray-', '--train-') only the full text has
    out = subprocess.run(
        [sys.executable, "-m", "align.train", "--help-all"], capture_output=True, text=True, check=True
    )
    return set(FLAG_RE.findall(out.stdout))


def missing_flags(old: list[str], now: set[str]) -> list[str]:
    return [f for f in old if f not in now]


def test_every_0_1_flag_is_still_a_flag():
    old = OLD.joinpath("train_flags.txt").read_text().split()
    assert len(old) > 100  # the file really lists the CLI
    assert missing_flags(old, help_flags()) == []


def test_negative_control_a_removed_flag_is_caught():
    assert missing_flags(["--lr", "--no-such-flag"], {"--lr", "--steps"}) == ["--no-such-flag"]


def test_a_0_1_config_json_loads_into_the_same_config():
    old = json.loads(OLD.joinpath("config.json").read_text())
    old.pop("model")  # train() adds the resolved model path beside the config's fields
    now = asdict(from_dict(TrainConfig, old))
    assert subset(now, old) == old  # every 0.1.0 key, nested sections included, round-trips unchanged (new keys may
    # join later: an old run still resumes)


def subset(d: dict, like: dict) -> dict:
    """``d`` restricted to the keys of ``like``, nested dicts alike (a key ``like`` has and ``d`` lacks: missing)."""
    return {k: subset(d[k], v) if isinstance(v, dict) and isinstance(d.get(k), dict) else d.get(k, "<missing>")
            for k, v in like.items()}  # fmt: skip


def test_negative_control_a_dropped_key_is_caught():
    assert subset({"a": 1, "s": {"x": 2}}, {"a": 1, "s": {"x": 2, "y": 3}}) == {"a": 1, "s": {"x": 2, "y": "<missing>"}}


def test_negative_control_a_config_with_an_unknown_key_is_refused():
    old = json.loads(OLD.joinpath("config.json").read_text())
    old.pop("model")
    old["loss"]["no_such_key"] = 1
    with pytest.raises(ValueError, match="no_such_key"):
        from_dict(TrainConfig, old)
