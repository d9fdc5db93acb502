"""docs/from-trl.md's converted TRL quickstart runs: the script as written, on the README's tiny stand-in model
(examples/own_data/make_tiny.py) and examples/own_data's rows, with fewer tokens and epochs."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples" / "own_data"


def quickstart_script() -> str:
    text = (ROOT / "docs" / "from-trl.md").read_text()
    return re.search(r"```python\n(# train_grpo\.py.*?)```", text, flags=re.DOTALL).group(1)


def stand_in(script: str, model: Path, out: Path) -> str:
    """The script with its model, data and output paths and its sizes swapped for the tiny stand-in's."""
    for pattern, value in (
        (r'^MODEL = "[^"]*"', f"MODEL = {str(model)!r}"),
        (r'^DATA = "[^"]*"', f"DATA = {str(EX / 'train.jsonl')!r}"),
        (r'^OUT = "[^"]*"', f"OUT = {str(out)!r}"),
        (r"max_tokens=256,", "max_tokens=8,"),
        (r"epochs=3,", "epochs=0.25,"),
        (r"group_size=8,", "group_size=4,"),
    ):
        script, n = re.subn(pattern, value, script, flags=re.MULTILINE)
        assert n == 1, pattern  # the doc still has the line the stand-in swaps
    return script


def test_the_converted_trl_quickstart_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("make_tiny", EX / "make_tiny.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    make_tiny.main(str(tmp_path / "tiny"))
    out = tmp_path / "run"
    exec(compile(stand_in(quickstart_script(), tmp_path / "tiny", out), "train_grpo.py", "exec"), {})  # noqa: S102
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = len((EX / "train.jsonl").read_text().splitlines())
    steps = [r for r in recs if "reward_mean" in r]
    assert len(steps) == -(-rows // 4)  # ceil(0.25 epochs x rows / 1 prompt per step)
    assert all(r["reward_mean"] <= 0 and r.get("reward_errors", 0) == 0 for r in steps)  # -|20 - len|: scored
