"""Real-model defaults, the built-in task's own settings (applied only when it runs) and config_sources.json."""

from __future__ import annotations

import json

from align.run.presets import parse
from align.run.sources import apply_backend_defaults, apply_task_defaults, record, sources_of
from align.tasks import load_task
from align.train import CLI_PREFIXES, TrainConfig, main

TOY = load_task("reverse").TRAIN_DEFAULTS


def _parse(argv):
    return parse(TrainConfig, argv, CLI_PREFIXES, log=lambda _: None)


def test_a_user_checkpoint_gets_real_model_defaults_and_the_builtin_task_its_own(tmp_path):
    user = _parse(["--train-data", "x.jsonl", "--model", "m"])
    assert (user.lr, user.max_tokens, user.group_size, user.loss.eps_high, user.loss.kl_coef) == (1e-6, 256, 8, 0.28, 0)
    assert sources_of(user)["lr"] == "default" and sources_of(user)["data.train_data"] == "flag"
    toy = _parse([])  # the built-in task runs: TRAIN_DEFAULTS over the defaults, nothing else changes
    assert (toy.lr, toy.max_tokens, toy.loss.eps_high) == (TOY["lr"], TOY["max_tokens"], TOY["loss.eps_high"])
    assert {k for k, v in sources_of(toy).items() if v != "default"} == set(TOY)
    # a flag, a --config key win over the task; an --env or --tools run is no built-in task
    assert _parse(["--lr", "1e-6"]).lr == 1e-6 and sources_of(_parse(["--lr", "1e-6"]))["lr"] == "flag"
    (tmp_path / "r.toml").write_text("max-tokens = 300\n")
    filed = _parse(["--config", str(tmp_path / "r.toml")])
    assert filed.max_tokens == 300 and sources_of(filed)["max_tokens"] == "file" and filed.lr == TOY["lr"]
    assert _parse(["--tools", "t.py:f", "--model", "m", "--train-data", "x.jsonl"]).lr == 1e-6


def test_python_api_applies_the_task_only_where_nothing_was_said():
    cfg = TrainConfig(lr=2e-4)  # code: kept; max_tokens untouched in code: the task's
    apply_task_defaults(cfg, TOY)
    assert (cfg.lr, cfg.max_tokens) == (2e-4, TOY["max_tokens"])
    assert sources_of(cfg)["lr"] == "code" and sources_of(cfg)["max_tokens"] == "task"
    flagged = record(TrainConfig(), {"max_tokens": "flag"})  # negative control: a recorded flag at the default value
    apply_task_defaults(flagged, TOY)
    assert flagged.max_tokens == 256 and flagged.lr == TOY["lr"]


def test_saved_config_reloads_with_its_own_values(tmp_path):
    """config.json holds every value: reloaded with --config, the task's layer changes none of them."""
    saved = json.loads(json.dumps(__import__("dataclasses").asdict(TrainConfig())))  # a user run's, lr 1e-6
    saved["data"]["train_data"] = None  # ... even where the built-in task would run
    (tmp_path / "config.json").write_text(json.dumps(saved))
    cfg = _parse(["--config", str(tmp_path / "config.json")])
    assert cfg == TrainConfig() and set(sources_of(cfg).values()) == {"file"}


def test_cli_run_writes_sources_and_resumes(tmp_path, builtin_model):
    out = tmp_path / "run"
    argv = ["--model", builtin_model, "--out", str(out), "--prompts-per-step", "2", "--group-size", "2"]
    argv += ["--eval-interval", "0", "--threads", "1"]
    assert main([*argv, "--steps", "1"]) == 0
    saved = json.loads((out / "config.json").read_text())
    src = json.loads((out / "config_sources.json").read_text())
    assert saved["lr"] == TOY["lr"] and saved["max_tokens"] == TOY["max_tokens"]
    assert (src["lr"], src["steps"], src["loss.eps_high"], src["micro_batch_size"]) == (
        "task",
        "flag",
        "task",
        "default",
    )
    assert main([*argv, "--steps", "2"]) == 0  # the same command resumes: the task's values again
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2]


def test_the_vllm_worker_turns_rho_correction_on_as_a_backend_default(tmp_path):
    """--rollout spool: vLLM's logprobs are not the trainer's, so the rho correction is on by default (the backend's
    row, BACKENDS["spool"].TRAIN_DEFAULTS); the native sampler's are exact: off. A flag or a file wins."""
    key = "loss.use_rho_correction"
    spool = _parse(["--rollout", "spool"])
    assert spool.loss.use_rho_correction is True and sources_of(spool)[key] == "backend"
    native = _parse([])  # negative control: the native sampler keeps the default
    assert native.loss.use_rho_correction is False and sources_of(native)[key] == "default"
    off = _parse(["--rollout", "spool", "--no-use-rho-correction"])
    assert off.loss.use_rho_correction is False and sources_of(off)[key] == "flag"
    (tmp_path / "r.toml").write_text("rollout = 'spool'\nuse-rho-correction = false\n")
    filed = _parse(["--config", str(tmp_path / "r.toml")])
    assert filed.loss.use_rho_correction is False and sources_of(filed)[key] == "file"
    preset = _parse(["--rollout", "spool", "--preset", "dapo"])  # a preset that says nothing of rho keeps it
    assert preset.loss.use_rho_correction is True
    api = TrainConfig(rollout="spool")  # the Python API: applied at run time where nothing was said
    apply_backend_defaults(api)
    assert api.loss.use_rho_correction is True and sources_of(api)[key] == "backend"
    code = TrainConfig(rollout="spool", lr=1e-5)
    apply_backend_defaults(code)
    assert sources_of(code)["lr"] == "code" and code.lr == 1e-5


def test_a_run_resumed_from_before_the_backend_default_keeps_its_value(tmp_path):
    """A --rollout spool run started when rho correction was off by default, resumed with the same command: it keeps
    rho off (layer 'resume', said in the log) instead of being refused for changed math; a value it never saved
    keeps today's default, and a flag that changes math is still refused (the negative control)."""
    import dataclasses

    import pytest

    from align.atomic import COMMIT_MARKER
    from align.run.parts import write_config

    out = tmp_path / "run"
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    (out / "checkpoints" / "step_1" / COMMIT_MARKER).write_text("")  # a pre-JSON marker: the run's own
    before = dataclasses.asdict(_parse(["--rollout", "spool", "--no-use-rho-correction"]))
    (out / "config.json").write_text(json.dumps({**before, "model": "m"}))
    cfg = _parse(["--rollout", "spool"])  # the same command today: the backend's default says on
    assert cfg.loss.use_rho_correction is True
    write_config(cfg, out, "m")
    assert cfg.loss.use_rho_correction is False
    assert json.loads((out / "config.json").read_text())["loss"]["use_rho_correction"] is False
    assert json.loads((out / "config_sources.json").read_text())["loss.use_rho_correction"] == "resume"
    del before["loss"]["use_rho_correction"]  # a config.json from before the field existed: today's value
    (out / "config.json").write_text(json.dumps({**before, "model": "m"}))
    cfg = _parse(["--rollout", "spool"])
    write_config(cfg, out, "m")
    assert cfg.loss.use_rho_correction is True
    with pytest.raises(ValueError, match="use_rho_correction: True -> False"):
        write_config(_parse(["--rollout", "spool", "--no-use-rho-correction"]), out, "m")
