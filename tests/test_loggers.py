"""--logger tensorboard | wandb: the optional metrics mirrors behind one adapter (metrics.jsonl stays the record).

tensorboard and wandb are not in the core or test venvs. The adapter is tested with test doubles installed in
``sys.modules`` (they record what the adapter calls); the real tensorboard test runs where ``tensorboard`` is
importable (add it to the test extras to run it in CI) and is skipped otherwise, so it is not counted here."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest
from helpers_train import PROMPTS, TOK, a_reward, records

from align.train import TrainConfig, train


def run(out: Path, model: str, logger: str, steps: int = 2) -> list[dict]:
    cfg = TrainConfig(out=str(out), steps=steps, prompts_per_step=2, group_size=2, max_tokens=3, checkpoint_every=1)
    cfg.eval.eval_interval = 0
    cfg.log.logger = logger
    train(cfg, model=model, tokenizer=TOK, prompts=PROMPTS[:4], reward=a_reward)
    return records(out)


def scalars(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float)) and not math.isnan(v)}


class FakeSummaryWriter:
    instances: ClassVar[list] = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        FakeSummaryWriter.instances.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_tensorboard_adapter_with_a_test_double(tmp_path, char_model, monkeypatch):
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    FakeSummaryWriter.instances = []
    recs = run(tmp_path / "tb", char_model, "tensorboard")
    (w,) = FakeSummaryWriter.instances
    assert w.closed and w.log_dir == str(tmp_path / "tb" / "tensorboard") and w.purge_step is None
    want = sorted((k, v, r["step"]) for r in recs for k, v in scalars(r).items())
    assert sorted(w.scalars) == want
    # resume: events after the checkpoint are purged, as the metrics.jsonl lines are
    recs = run(tmp_path / "tb", char_model, "tensorboard", steps=3)
    assert FakeSummaryWriter.instances[-1].purge_step == 3
    assert sorted(FakeSummaryWriter.instances[-1].scalars) == sorted(
        (k, v, r["step"]) for r in recs[2:] for k, v in scalars(r).items()
    )


def test_wandb_adapter_with_a_test_double(tmp_path, char_model, monkeypatch):
    calls: dict = {"init": [], "log": [], "finish": 0, "define": []}

    class Run:
        def log(self, d):
            calls["log"].append(d)

        def define_metric(self, name, step_metric=None):
            calls["define"].append((name, step_metric))

        def finish(self):
            calls["finish"] += 1

    fake = types.ModuleType("wandb")
    fake.util = types.SimpleNamespace(generate_id=lambda: "run123")
    fake.init = lambda **kw: calls["init"].append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    recs = run(tmp_path / "wb", char_model, "wandb")
    (init,) = calls["init"]
    assert init["id"] == "run123" and init["resume"] == "allow" and init["config"]["steps"] == 2
    assert calls["define"] == [("*", "step")] and calls["finish"] == 1
    assert [d["step"] for d in calls["log"]] == [r["step"] for r in recs]
    assert (tmp_path / "wb" / "wandb_id").read_text() == "run123"
    fake.util.generate_id = lambda: "other"  # a resumed run keeps its id
    run(tmp_path / "wb", char_model, "wandb", steps=3)
    assert calls["init"][-1]["id"] == "run123"


def test_missing_logger_package_names_the_extra(tmp_path, char_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'align\[tensorboard\]'"):
        run(tmp_path / "x", char_model, "tensorboard")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"pip install 'align\[wandb\]'"):
        run(tmp_path / "y", char_model, "wandb")
    with pytest.raises(ValueError, match="--logger must be one of"):
        TrainConfig(log={"logger": "mlflow"})


def test_tensorboard_for_real(tmp_path, char_model):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'align[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recs = run(tmp_path / "tb", char_model, "tensorboard")
    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("reward_mean")]
    assert got == [(r["step"], pytest.approx(r["reward_mean"])) for r in recs]
    assert "loss" in acc.Tags()["scalars"]
