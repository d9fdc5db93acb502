"""--preset: the table's values, precedence (defaults < preset < --config < flags), the printed line, config.json."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers_train import PROMPTS, TOK

from align.run.presets import PRESETS, build, parse
from align.run.sources import apply_task_defaults
from align.tasks import load_task
from align.train import CLI_PREFIXES, TrainConfig, train


def _parse(argv, lines=None):
    return parse(TrainConfig, argv, CLI_PREFIXES, log=(lines.append if lines is not None else lambda _: None))


def test_each_preset_sets_its_algorithm():
    base = TrainConfig()  # the built-in task runs: its own settings over the defaults
    apply_task_defaults(base, load_task("reverse").TRAIN_DEFAULTS)
    dr = _parse(["--preset", "dr_grpo", "--max-tokens", "12"])
    assert (dr.loss.name, dr.loss.max_len_norm, dr.loss.seq_count, dr.adv.scale) == ("constant_norm", 12, "all", "none")
    # an episode holds up to --max-turns turns of policy tokens, capped by --max-episode-tokens
    env = ["--preset", "dr_grpo", "--max-tokens", "12", "--env", "lean", "--max-turns", "3"]
    assert _parse(env).loss.max_len_norm == 36
    assert _parse([*env, "--max-episode-tokens", "30"]).loss.max_len_norm == 30
    assert (
        _parse(
            ["--preset", "dr_grpo", "--max-tokens", "12", "--task", "multiturn", "--max-turns", "2"]
        ).loss.max_len_norm
        == 24
    )
    dapo = _parse(["--preset", "dapo", "--max-tokens", "20"])
    assert (dapo.loss.name, dapo.loss.eps_low, dapo.loss.eps_high) == ("token_mean", 0.2, 0.28)
    assert dapo.adv.filter_zero_variance and dapo.adv.overlong_buffer == 4 and dapo.loss.kl_coef == 0.0
    gspo = _parse(["--preset", "gspo"])
    assert (gspo.loss.name, gspo.loss.eps_low, gspo.loss.eps_high) == ("gspo", 3e-4, 4e-4)
    cispo = _parse(["--preset", "cispo"])
    assert (cispo.loss.name, cispo.loss.eps_low) == ("cispo", 1.0)
    grpo = _parse(["--preset", "grpo"])
    assert (grpo.loss.name, grpo.adv.scale) == ("seq_mean_token_mean", "group")
    # negative control: without a preset every one of these is the default
    assert _parse([]) == base and (base.loss.name, base.adv.scale, base.loss.seq_count) == (
        "token_mean",
        "group",
        "nonempty",
    )
    for name in PRESETS:  # every preset parses into a valid config that records its name
        assert _parse(["--preset", name]).preset == name


def test_explicit_flags_and_config_keys_win_over_the_preset(tmp_path, capsys):
    lines: list[str] = []
    cfg = _parse(["--preset", "dr_grpo", "--adv-scale", "group", "--max-len-norm", "99"], lines)
    assert cfg.adv.scale == "group" and cfg.loss.max_len_norm == 99 and cfg.loss.name == "constant_norm"
    want = "[align] preset dr_grpo: loss.name=constant_norm, loss.seq_count=all, adv.baseline=mean; "
    assert lines == [want + "explicit values kept: loss.max_len_norm=99, adv.scale=group"]
    # a --config file's keys are explicit too; keys it lacks take the preset; flags beat the file
    conf = tmp_path / "partial.json"
    conf.write_text(json.dumps({"preset": "dapo", "loss": {"eps_high": 0.5}, "adv": {"filter_zero_variance": False}}))
    cfg = _parse(["--config", str(conf), "--eps-low", "0.1"])
    assert cfg.preset == "dapo" and cfg.loss.eps_high == 0.5 and not cfg.adv.filter_zero_variance
    assert cfg.loss.eps_low == 0.1 and cfg.loss.name == "token_mean" and cfg.adv.overlong_buffer == 2
    # a preset on the command line applies to what the file leaves unset
    conf.write_text(json.dumps({"loss": {"eps_high": 0.3}}))
    cfg = _parse(["--config", str(conf), "--preset", "gspo"])
    assert cfg.loss.name == "gspo" and cfg.loss.eps_high == 0.3 and cfg.loss.eps_low == 3e-4
    # --preset dr_grpo --loss constant_norm: the preset supplies max_len_norm, which the plain parse would demand
    cfg = _parse(["--preset", "dr_grpo", "--loss", "constant_norm"])
    assert cfg.loss.max_len_norm == cfg.max_tokens


def test_unknown_preset_is_named(capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["--preset", "ppo"])
    assert e.value.code == 2 and "--preset must be one of" in capsys.readouterr().err


def test_resolved_preset_is_saved_in_config_json_and_reloads(tmp_path, char_model):
    model = char_model
    out = tmp_path / "run"
    argv = ["--preset", "dr_grpo", "--out", str(out), "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
            "--max-tokens", "4", "--warmup-steps", "0", "--eval-interval", "0", "--micro-batch-size", "2"]  # fmt: skip
    cfg = _parse(argv)
    train(
        cfg,
        model=model,
        tokenizer=TOK,
        prompts=PROMPTS[:4],
        reward=lambda prompt, completion, **_: completion.count("a"),
    )
    saved = json.loads((out / "config.json").read_text())
    assert saved["preset"] == "dr_grpo"
    assert saved["loss"]["name"] == "constant_norm" and saved["loss"]["max_len_norm"] == 4
    assert saved["loss"]["seq_count"] == "all" and saved["adv"]["scale"] == "none"
    # reloading the saved config gives the same config (every key in it is explicit); train() recorded the model
    again = _parse(["--config", str(out / "config.json")])
    assert again.model == model and dataclasses.replace(again, model=None) == cfg


def test_build_is_the_python_api_of_a_preset():
    cfg = build(TrainConfig, "dr_grpo", {"max_tokens": 16, "adv": {"scale": "group"}})
    assert cfg.preset == "dr_grpo" and cfg.loss.max_len_norm == 16 and cfg.adv.scale == "group"
    assert cfg == _parse(["--preset", "dr_grpo", "--max-tokens", "16", "--adv-scale", "group"])
    with pytest.raises(ValueError, match="preset 'ppo' is unknown"):
        build(TrainConfig, "ppo")
    with pytest.raises(ValueError, match="unknown LossConfig field"):
        build(TrainConfig, "grpo", {"loss": {"nmae": "x"}})
