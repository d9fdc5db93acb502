"""Every recipe in examples/recipes/ loads through the real ``--config`` parser (parse only: no model, no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from align.run.presets import parse
from align.run.sources import sources_of
from align.train import CLI_PREFIXES, TrainConfig

RECIPES = sorted((Path(__file__).parents[1] / "examples" / "recipes").glob("*.toml"))


def test_there_are_recipes():
    assert len(RECIPES) >= 5, RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_parses_and_states_its_budget(path):
    cfg = parse(TrainConfig, ["--config", str(path)], CLI_PREFIXES, log=lambda _: None)
    assert cfg.model and (cfg.data.train_data or cfg.envs.enabled)  # a user's checkpoint: no built-in task values
    assert "task" not in sources_of(cfg).values()
    assert sources_of(cfg)["lr"] == "file" and cfg.lr <= 1e-5
    header = path.read_text().split("\n\n")[0]
    for words in ("Memory (estimate", "Time (estimate", "80 GB", "141 GB", "python -m align.train --config"):
        assert words in header, (path.name, words)
